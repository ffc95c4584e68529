//! Streaming separation of a reasoning block from the visible answer.
//!
//! Text deltas go in; `(reasoning, content)` deltas come out. A delimiter may be split across
//! deltas, so a tail of a delta that could still become a delimiter is held back until the
//! next delta decides it: no delimiter byte ever reaches either field. Like llama.cpp's
//! `--reasoning-format auto`, a block is recognised only where the output opens with it
//! (leading whitespace allowed); a delimiter later in the answer is ordinary text.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Only whitespace so far: the output may still open a block.
    Start,
    /// Inside the block opened by pair `usize`.
    Reasoning(usize),
    /// Just after a closing delimiter: whitespace separating it from the answer is dropped.
    AfterClose,
    Content,
}

#[derive(Debug, Clone)]
pub struct ThinkSplitter {
    pairs: Vec<(String, String)>,
    /// Headers that may open the answer right after a closed block (a channel template's
    /// `<|start|>assistant<|channel|>final<|message|>`): dropped, never shown as content.
    headers: Vec<String>,
    state: State,
    pending: String,
    opened: bool,
    closed: bool,
}

pub const DEFAULT_PAIR: (&str, &str) = ("<think>", "</think>");

/// Length of the longest proper prefix of `delim` that `s` ends with.
fn held_suffix(s: &str, delim: &str) -> usize {
    let max = s.len().min(delim.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| delim.is_char_boundary(k) && s.is_char_boundary(s.len() - k) && s.ends_with(&delim[..k]))
        .unwrap_or(0)
}

impl ThinkSplitter {
    /// `pairs` are (open, close) delimiters; empty means `<think>`/`</think>`.
    /// `start_in_reasoning`: the prompt already opened the block (for pair 0).
    pub fn new(pairs: Vec<(String, String)>, start_in_reasoning: bool) -> Self {
        let pairs: Vec<(String, String)> = if pairs.is_empty() {
            vec![(DEFAULT_PAIR.0.to_owned(), DEFAULT_PAIR.1.to_owned())]
        } else {
            pairs.into_iter().filter(|(o, c)| !o.is_empty() && !c.is_empty()).collect()
        };
        ThinkSplitter {
            state: if start_in_reasoning && !pairs.is_empty() { State::Reasoning(0) } else { State::Start },
            opened: start_in_reasoning,
            pairs,
            headers: Vec::new(),
            pending: String::new(),
            closed: false,
        }
    }

    /// The answer after a closed block may open with one of `headers`, which is dropped.
    pub fn with_answer_headers(mut self, headers: Vec<String>) -> Self {
        self.headers = headers.into_iter().filter(|h| !h.is_empty()).collect();
        self
    }

    /// Whether a reasoning block was opened (by the output or the prompt).
    pub fn opened(&self) -> bool {
        self.opened
    }

    /// Whether the reasoning block was closed.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Whether the splitter is inside an unclosed reasoning block.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::Reasoning(_))
    }

    /// Where `text` would go if it goes wholly, unchanged, to one side: `Some(true)` for
    /// reasoning, `Some(false)` for content, `None` when [`feed`](Self::feed) must split it.
    /// Feeding such a delta changes no state, so a caller may forward it as it is: the
    /// common case (a token in the middle of either part) costs no copy.
    pub fn passes_whole(&self, text: &str) -> Option<bool> {
        if !self.pending.is_empty() || text.is_empty() {
            return None;
        }
        match self.state {
            State::Content => Some(false),
            State::Reasoning(i) => {
                let close = self.pairs[i].1.as_str();
                let clear =
                    memchr::memmem::find(text.as_bytes(), close.as_bytes()).is_none() && held_suffix(text, close) == 0;
                clear.then_some(true)
            }
            State::Start | State::AfterClose => None,
        }
    }

    pub fn feed(&mut self, text: &str) -> (String, String) {
        let mut reasoning = String::new();
        let mut content = String::new();
        let buf = if self.pending.is_empty() {
            text.to_owned()
        } else {
            let mut b = std::mem::take(&mut self.pending);
            b.push_str(text);
            b
        };
        let mut s = buf.as_str();
        loop {
            match self.state {
                State::Start => {
                    let t = s.trim_start();
                    if t.is_empty() {
                        self.pending.push_str(s);
                        break;
                    }
                    if let Some(i) = self.pairs.iter().position(|(o, _)| t.starts_with(o.as_str())) {
                        s = &t[self.pairs[i].0.len()..];
                        self.state = State::Reasoning(i);
                        self.opened = true;
                        continue;
                    }
                    if self.pairs.iter().any(|(o, _)| o.starts_with(t)) {
                        self.pending.push_str(s);
                        break;
                    }
                    self.state = State::Content;
                }
                State::Reasoning(i) => {
                    let close = self.pairs[i].1.as_str();
                    if let Some(p) = s.find(close) {
                        reasoning.push_str(&s[..p]);
                        s = &s[p + close.len()..];
                        self.state = State::AfterClose;
                        self.closed = true;
                        continue;
                    }
                    let hold = held_suffix(s, close);
                    reasoning.push_str(&s[..s.len() - hold]);
                    self.pending.push_str(&s[s.len() - hold..]);
                    break;
                }
                State::AfterClose => {
                    s = s.trim_start();
                    if s.is_empty() {
                        break;
                    }
                    if let Some(h) = self.headers.iter().find(|h| s.starts_with(h.as_str())) {
                        s = &s[h.len()..];
                        self.state = State::Content;
                        continue;
                    }
                    if self.headers.iter().any(|h| h.starts_with(s)) {
                        self.pending.push_str(s);
                        break;
                    }
                    self.state = State::Content;
                }
                State::Content => {
                    content.push_str(s);
                    break;
                }
            }
        }
        (reasoning, content)
    }

    /// Flush what was held back: the stream has ended.
    pub fn finish(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::Reasoning(_) => (rest, String::new()),
            State::Start | State::Content => {
                if !rest.is_empty() {
                    self.state = State::Content;
                }
                (String::new(), rest)
            }
            // A header cut short by the end of the output is text the model wrote.
            State::AfterClose => (String::new(), rest),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_deltas_pass_through_exactly_when_feed_would_keep_them_whole() {
        let deltas = ["<th", "ink>", "a", " b<", "/th", "x", "</think>", "  ", "answer", " </think>", "é"];
        let mut s = ThinkSplitter::new(vec![], false);
        for d in deltas {
            let whole = s.passes_whole(d);
            let before = (s.state, s.pending.clone());
            let (r, c) = s.feed(d);
            match whole {
                Some(true) => assert_eq!((r.as_str(), c.as_str()), (d, "")),
                Some(false) => assert_eq!((r.as_str(), c.as_str()), ("", d)),
                None => continue,
            }
            assert_eq!((s.state, s.pending.clone()), before, "{d:?}");
        }
    }

    fn split(deltas: &[&str], start_in: bool) -> (String, String, bool) {
        let mut t = ThinkSplitter::new(vec![], start_in);
        let (mut r, mut c) = (String::new(), String::new());
        for d in deltas {
            let (a, b) = t.feed(d);
            r += &a;
            c += &b;
        }
        let (a, b) = t.finish();
        (r + &a, c + &b, t.closed())
    }

    #[test]
    fn delimiters_split_anywhere_never_leak() {
        let text = "<think>plan a</think>\n\nanswer";
        for cut in 0..=text.len() {
            for cut2 in cut..=text.len() {
                let (r, c, closed) = split(&[&text[..cut], &text[cut..cut2], &text[cut2..]], false);
                assert_eq!((r.as_str(), c.as_str(), closed), ("plan a", "answer", true), "cuts {cut} {cut2}");
            }
        }
    }

    #[test]
    fn unclosed_block_leaves_content_empty() {
        let (r, c, closed) = split(&["<think>still ", "thinking </th"], false);
        assert_eq!((r.as_str(), c.as_str(), closed), ("still thinking </th", "", false));
    }

    #[test]
    fn no_block_is_all_content_and_late_tags_are_text() {
        let (r, c, _) = split(&["  <thi", "nk? no. <think>x</think>"], false);
        assert_eq!(r, "");
        assert_eq!(c, "  <think? no. <think>x</think>");
    }

    #[test]
    fn starting_inside_reasoning() {
        let (r, c, closed) = split(&["idea</think>done"], true);
        assert_eq!((r.as_str(), c.as_str(), closed), ("idea", "done", true));
    }

    #[test]
    fn custom_channel_pair() {
        let mut t = ThinkSplitter::new(
            vec![("<think>".into(), "</think>".into()), ("<|channel|>analysis<|message|>".into(), "<|end|>".into())],
            false,
        );
        let (r1, c1) = t.feed("<|channel|>analysis<|mess");
        let (r2, c2) = t.feed("age|>hmm<|en");
        let (r3, c3) = t.feed("d|>ok");
        assert_eq!(r1 + &r2 + &r3, "hmm");
        assert_eq!(c1 + &c2 + &c3, "ok");
    }

    #[test]
    fn channel_answer_header_is_dropped_wherever_it_is_cut() {
        let text = "<|channel|>analysis<|message|>thought<|end|><|start|>assistant<|channel|>final<|message|>answer";
        let pairs = vec![
            ("<think>".to_owned(), "</think>".to_owned()),
            ("<|channel|>analysis<|message|>".into(), "<|end|>".into()),
        ];
        let headers =
            vec!["<|start|>assistant<|channel|>final<|message|>".to_owned(), "<|channel|>final<|message|>".into()];
        for cut in 0..=text.len() {
            let mut t = ThinkSplitter::new(pairs.clone(), false).with_answer_headers(headers.clone());
            let (r1, c1) = t.feed(&text[..cut]);
            let (r2, c2) = t.feed(&text[cut..]);
            let (r3, c3) = t.finish();
            assert_eq!((r1 + &r2 + &r3, c1 + &c2 + &c3), ("thought".to_owned(), "answer".to_owned()), "cut {cut}");
        }
        let mut t = ThinkSplitter::new(pairs, false).with_answer_headers(headers);
        let (r, c) = t.feed("<|channel|>analysis<|message|>x<|end|><|start|>assist");
        let (r2, c2) = t.finish();
        assert_eq!((r + &r2, c + &c2), ("x".to_owned(), "<|start|>assist".to_owned()));
    }
}

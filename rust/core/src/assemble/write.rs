//! The response writer: the assembled response written out by hand.

use serde_json::{Map, Value};

use super::{logprob_slot, Kind, CHAT_LOGPROBS, TEXT_LOGPROBS};

/// The response, serialized with logprob entries written out raw.
pub(super) struct Response<'a> {
    pub(super) base: Map<String, Value>,
    pub(super) choices: Vec<ChoiceOut<'a>>,
}

pub(super) struct ChoiceOut<'a> {
    pub(super) base: Map<String, Value>,
    pub(super) logprobs: Option<LogprobsOut<'a>>,
}

pub(super) struct LogprobsOut<'a> {
    pub(super) kind: Kind,
    pub(super) items: &'a [Option<String>; 6],
}

// The response is written by hand so the logprob entries, kept as the engine wrote them and
// validated when their frames were read, go out as they are: serde_json would re-validate
// them to embed them as raw values.
pub(super) fn write_key(out: &mut Vec<u8>, first: &mut bool, key: &str) -> serde_json::Result<()> {
    if !std::mem::take(first) {
        out.push(b',');
    }
    serde_json::to_writer(&mut *out, key)?;
    out.push(b':');
    Ok(())
}

impl Response<'_> {
    pub(super) fn write(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        out.push(b'{');
        let mut first = true;
        for (k, v) in &self.base {
            write_key(out, &mut first, k)?;
            if k == "choices" {
                out.push(b'[');
                for (i, c) in self.choices.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    c.write(out)?;
                }
                out.push(b']');
            } else {
                serde_json::to_writer(&mut *out, v)?;
            }
        }
        out.push(b'}');
        Ok(())
    }
}

impl ChoiceOut<'_> {
    pub(super) fn write(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        out.push(b'{');
        let mut first = true;
        for (k, v) in &self.base {
            write_key(out, &mut first, k)?;
            match (k.as_str(), &self.logprobs) {
                ("logprobs", Some(lp)) => lp.write(out)?,
                _ => serde_json::to_writer(&mut *out, v)?,
            }
        }
        out.push(b'}');
        Ok(())
    }
}

impl LogprobsOut<'_> {
    pub(super) fn write(&self, out: &mut Vec<u8>) -> serde_json::Result<()> {
        out.push(b'{');
        let mut first = true;
        let names = if self.kind == Kind::Chat { CHAT_LOGPROBS } else { TEXT_LOGPROBS };
        for name in names {
            let items = self.items[logprob_slot(name)].as_ref();
            if items.is_none() && self.kind == Kind::Chat {
                continue;
            }
            write_key(out, &mut first, name)?;
            out.push(b'[');
            out.extend_from_slice(items.map_or("", String::as_str).as_bytes());
            out.push(b']');
        }
        out.push(b'}');
        Ok(())
    }
}

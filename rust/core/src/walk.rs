//! The one walk over an OpenAI stream frame: its members, each choice of `choices`, and each
//! choice's `delta`, in one pass of [`Reader`]. The relay's classification ([`crate::frame`])
//! and the assembler's single-pass read (`assemble::read`) each say what a member means to
//! them (a [`Visit`]); where `choices` and `delta` sit, that neither is given twice, and
//! that a null one is none, is said here once.

use crate::json_read::{Bail, Reader, R};

/// What one reader of frames makes of their members. Each method is called with the reader
/// at the member's value, and must consume it (read it or skip it) or [`Bail`].
pub trait Visit<'a> {
    /// A member of the frame other than `choices`.
    fn frame(&mut self, r: &mut Reader<'a>, key: &'a [u8]) -> R<()>;
    /// A new choice begins.
    fn choice_begins(&mut self);
    /// A member of the current choice other than `delta`.
    fn choice(&mut self, r: &mut Reader<'a>, key: &'a [u8]) -> R<()>;
    /// The current choice has a non-null `delta`; its members follow.
    fn delta_begins(&mut self) {}
    /// A member of the current choice's `delta`.
    fn delta(&mut self, r: &mut Reader<'a>, key: &'a [u8]) -> R<()>;
    /// The current choice has ended.
    fn choice_ends(&mut self) -> R<()> {
        Ok(())
    }
}

/// Walk `data`, one frame, through `v`; [`Bail`] where it is not one JSON object of the
/// frame's shape (or `v` bails).
pub fn walk<'a, V: Visit<'a>>(data: &'a str, v: &mut V) -> R<()> {
    let mut r = Reader::new(data);
    let mut choices = false;
    r.object(|r, key| {
        if key != b"choices" {
            return v.frame(r, key);
        }
        if std::mem::replace(&mut choices, true) {
            return Err(Bail);
        }
        if r.null()? {
            return Ok(());
        }
        r.array(|r| {
            v.choice_begins();
            let mut delta = false;
            r.object(|r, key| {
                if key != b"delta" {
                    return v.choice(r, key);
                }
                if std::mem::replace(&mut delta, true) {
                    return Err(Bail);
                }
                if r.null()? {
                    return Ok(());
                }
                v.delta_begins();
                r.object(|r, key| v.delta(r, key))
            })?;
            v.choice_ends()
        })
    })?;
    r.end()
}

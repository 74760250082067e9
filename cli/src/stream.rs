//! Incremental detokenization: print the text of a token stream as it grows.

use anyhow::{anyhow, Result};
use tokenizers::Tokenizer;

/// Decodes a growing id sequence and hands out only the new suffix of the text. A suffix that
/// ends inside a multi-byte character (the byte-level decoder yields U+FFFD there) is held back
/// until the next tokens complete it.
pub struct TextStream<'t> {
    tk: &'t Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl<'t> TextStream<'t> {
    pub fn new(tk: &'t Tokenizer) -> Self {
        TextStream {
            tk,
            ids: Vec::new(),
            printed: 0,
        }
    }

    fn decoded(&self) -> Result<String> {
        self.tk
            .decode(&self.ids, false)
            .map_err(|e| anyhow!("decoding the generated ids: {e}"))
    }

    /// Append `ids`; return the text that became final.
    pub fn push(&mut self, ids: &[u32]) -> Result<String> {
        self.ids.extend_from_slice(ids);
        let s = self.decoded()?;
        if s.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        Ok(self.take(&s))
    }

    /// The rest of the text (an unfinished character included, as U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        let s = self.decoded()?;
        Ok(self.take(&s))
    }

    fn take(&mut self, s: &str) -> String {
        // The decoded text of a longer sequence extends the shorter one for byte-level BPE;
        // if a decoder ever rewrites the past, print nothing rather than a broken suffix.
        match s.get(self.printed..) {
            Some(new) => {
                self.printed = s.len();
                new.to_string()
            }
            None => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn tokenizer() -> Tokenizer {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/target/tokenizer.json");
        Tokenizer::from_file(p).unwrap()
    }

    #[test]
    fn streamed_pieces_concatenate_to_the_full_decode() {
        let tk = tokenizer();
        // multi-byte characters split over byte tokens, mixed with code
        let text =
            "def f(x):\n    return 'h\u{e9}llo \u{1F600} w\u{f6}rld' + x  # \u{4e2d}\u{6587}\n";
        let ids = tk.encode(text, false).unwrap().get_ids().to_vec();
        for step in [1usize, 2, 3, 5] {
            let mut st = TextStream::new(&tk);
            let mut out = String::new();
            for c in ids.chunks(step) {
                let piece = st.push(c).unwrap();
                assert!(!piece.contains('\u{FFFD}'), "half a character was printed");
                out += &piece;
            }
            out += &st.finish().unwrap();
            assert_eq!(out, text, "step {step}");
        }
    }

    #[test]
    fn an_unfinished_character_is_held_back_then_flushed() {
        let tk = tokenizer();
        let ids = tk.encode("\u{1F600}", false).unwrap().get_ids().to_vec();
        assert!(ids.len() > 1, "the emoji should take several byte tokens");
        let mut st = TextStream::new(&tk);
        assert_eq!(st.push(&ids[..1]).unwrap(), "");
        assert_eq!(st.finish().unwrap(), "\u{FFFD}");
    }
}

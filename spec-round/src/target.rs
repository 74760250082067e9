//! The object-safe seam between the round engine and a target model.

use dflash_backend::{Backend, Weight};

use crate::Result;

/// Static facts about a target the engine needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetInfo {
    /// Number of decoder layers.
    pub n_layers: usize,
    /// Residual-stream width.
    pub hidden: usize,
    /// Rows of the lm_head (the logits width).
    pub vocab: usize,
    /// Most positions the target's caches hold (prompt + everything committed + one verify).
    pub ctx_cap: usize,
}

impl TargetInfo {
    /// Check tap layer ids: `-1` (embedding output) ..= `n_layers - 2`
    /// (`n_layers - 1` would be the post-final-norm state in HF's convention, see
    /// `dflash-semantics.md` §2.2).
    pub fn check_taps(&self, taps: &[i32]) -> Result<()> {
        let max = self.n_layers as i64 - 2;
        for &l in taps {
            if l < -1 || l as i64 > max {
                return Err(crate::SpecError::TapLayer {
                    layer: l,
                    n_layers: self.n_layers,
                    max,
                });
            }
        }
        Ok(())
    }
}

/// How a target with recurrent state (hybrid, Gated DeltaNet) undoes the rejected tail of a
/// verify. Dense targets roll back by truncating their KV cache and ignore the arm.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RollbackArm {
    /// Keep the conv and recurrent state of every verified position; restore the accepted one.
    #[default]
    Stash,
    /// Snapshot before the verify; on a partial accept restore it and re-run the kept prefix.
    Replay,
    /// Run both, compare every state bit for bit, error on any difference (a test arm).
    Gate,
}

/// What one target forward returns.
pub struct Forward<B: Backend> {
    /// Argmax of each returned row (every verified row; for `prime`, the last prompt row only).
    pub argmax: Vec<u32>,
    /// `[rows, vocab]` logits when requested.
    pub logits: Option<B::Buf>,
    /// `[rows, taps.len() * hidden]`: residual stream after each requested layer, concatenated
    /// in the order requested; `None` when no taps were requested.
    pub taps: Option<B::Buf>,
}

/// A target model as the round engine sees it. Object safe: the engine holds
/// `&mut dyn Target<B>`.
///
/// Protocol: `prime` (resets the target, runs and commits the prompt) then any number of
/// `verify` at the committed length followed by exactly one `commit(keep)` with
/// `1 <= keep <= rows verified`. Committed positions are `0..pos()`.
pub trait Target<B: Backend> {
    /// Static facts (layers, hidden, vocab, context cap).
    fn info(&self) -> TargetInfo;
    /// Number of committed positions.
    fn pos(&self) -> usize;
    /// The rollback arm used by the following verifies (dense targets ignore it).
    fn set_rollback(&mut self, arm: RollbackArm);
    /// Reset the caches and run the prompt at positions `0..prompt.len()`, committing it.
    /// Returns the argmax of the last prompt row (the first generated token) and the taps of
    /// every prompt row.
    fn prime(&mut self, be: &B, prompt: &[u32], taps: &[i32]) -> Result<Forward<B>>;
    /// Run `tokens` at positions `start..start + tokens.len()` (`start` must equal `pos()`),
    /// returning per-row argmax, taps and, on request, logits. The rows stay pending until
    /// `commit`.
    fn verify(
        &mut self,
        be: &B,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        want_logits: bool,
    ) -> Result<Forward<B>>;
    /// Keep the first `keep` rows of the last verify and roll back the rest.
    fn commit(&mut self, be: &B, keep: usize) -> Result<()>;
    /// Embedding rows of `ids` into `out` (`[ids.len(), hidden]`), unscaled.
    fn embed_rows(&self, be: &B, ids: &[u32], out: &mut B::Buf) -> dflash_backend::Result<()>;
    /// The lm_head (`[vocab, hidden]`).
    fn lm_head(&self) -> &Weight<B>;
}

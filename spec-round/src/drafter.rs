//! What the round engine needs from a drafter.

use dflash_backend::Backend;

use crate::{Result, Target};

/// Per-round drafting options taken from [`crate::SpecConfig`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftOptions {
    /// Run the Markov chain when the drafter has one.
    pub markov: bool,
    /// Multiplier on the borrowed embedding rows (gemma-class targets: `sqrt(hidden)`).
    pub emb_scale: f32,
}

/// A block drafter conditioned on target taps (DFlash / DSpark), as the engine drives it.
///
/// The drafter keeps its own context cache of ingested rows; the engine keeps it in step with
/// the target: at the start of every round `ctx_len() == target.pos()`.
pub trait Drafter<B: Backend> {
    /// Target layers whose residual stream the drafter reads, in order.
    fn tap_layers(&self) -> &[i32];
    /// Width of one tap row (the target hidden size the drafter was built for).
    fn hidden(&self) -> usize;
    /// Drafts proposed per round (`block - 1` in the DFlash layout, `block` in the
    /// anchor-predicts layout).
    fn n_drafts(&self) -> usize;
    /// Forget every context row and make room for `ctx_cap` context positions (a block past
    /// the last context row must still fit).
    fn reset(&mut self, be: &B, ctx_cap: usize) -> Result<()>;
    /// Context rows ingested so far.
    fn ctx_len(&self) -> usize;
    /// Append `rows` context rows at positions `ctx_len()..`; `taps` is
    /// `[rows, tap_layers().len() * hidden()]`.
    fn ingest(&mut self, be: &B, taps: &B::Buf, rows: usize) -> Result<()>;
    /// Propose at least `n` (`1..=n_drafts()`) tokens following `anchor`, which sits at
    /// position `pos` (`== ctx_len()`), borrowing the target's embedding rows and lm_head.
    /// The block is always the drafter's full block: `n` only bounds the work after it (the
    /// lm_head rows and the Markov chain), so the first `n` drafts do not depend on `n`.
    fn draft(
        &mut self,
        be: &B,
        target: &dyn Target<B>,
        anchor: u32,
        pos: usize,
        n: usize,
        opts: DraftOptions,
    ) -> Result<Vec<u32>>;
}

//! The drafter's own lm_head (`--draft-head`): a re-encoded copy of the target's, handed to
//! [`dflash_spec_round::DflashDrafter::with_head`].
//!
//! The drafter's logits only decide what it proposes; the target verifies every token, so a
//! cheaper head (e.g. [`WeightFormat::Q8_0A8`]: integer dots on the CPU) changes the speed
//! and at most the acceptance, never the committed stream. The target keeps its own head.

use anyhow::{Context, Result};
use dflash_backend::{Backend, HostWeight, Weight, WeightFormat};

/// A copy of `head` (any format) re-encoded as `format`: its rows decoded exactly
/// (`gather_rows`), then encoded with `HostWeight::from_f32` and uploaded.
pub fn reencode_head<B: Backend>(
    be: &B,
    head: &Weight<B>,
    format: WeightFormat,
) -> Result<Weight<B>> {
    let (rows, cols) = (head.rows, head.cols);
    let ids: Vec<u32> = (0..rows)
        .map(|i| u32::try_from(i).context("lm_head rows do not fit u32 ids"))
        .collect::<Result<_>>()?;
    let mut buf = be.zeros(rows * cols)?;
    be.gather_rows(head, &ids, &mut buf)?;
    let vals = be.download(&buf)?;
    let hw = HostWeight::from_f32(
        format!("{} ({format:?} copy for the drafter)", head.name),
        rows,
        cols,
        &vals,
        format,
    )
    .with_context(|| format!("re-encoding {} as {format:?}", head.name))?;
    Ok(be.upload_weight(&hw)?)
}

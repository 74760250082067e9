//! The drafter as the CLI drives it: the DFlash / DSpark drafter with its KV cache, borrowing
//! the target's embedding rows and either the target's lm_head or its own re-encoded copy
//! of it (`--draft-head`).
//!
//! The drafter's logits only decide what it proposes; the target verifies every token, so a
//! cheaper head (e.g. [`WeightFormat::Q8_0A8`]: integer dots on the CPU) changes the speed
//! and at most the acceptance, never the committed stream. The target keeps its own head.

use anyhow::{Context, Result};
use dflash_backend::{Backend, HostWeight, Weight, WeightFormat};
use dflash_draft_model::{DraftOptions as DmOptions, Drafter as DraftModel, TargetLend};
use dflash_kv::DraftKv;
use dflash_spec_round::{DraftOptions, Drafter, SpecError, Target};

/// Embedding rows from the target, lm_head from `head` (the target's own when `None`).
struct Lend<'a, B: Backend> {
    target: &'a dyn Target<B>,
    head: Option<&'a Weight<B>>,
}

impl<B: Backend> TargetLend<B> for Lend<'_, B> {
    fn hidden_size(&self) -> usize {
        self.target.info().hidden
    }
    fn vocab_size(&self) -> usize {
        self.target.info().vocab
    }
    fn embed(&self, be: &B, ids: &[u32], out: &mut B::Buf) -> dflash_backend::Result<()> {
        self.target.embed_rows(be, ids, out)
    }
    fn lm_head(&self) -> &Weight<B> {
        self.head.unwrap_or_else(|| self.target.lm_head())
    }
}

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

fn draft_err(e: dflash_draft_model::DraftError) -> SpecError {
    SpecError::Drafter(Box::new(e))
}

/// A loaded drafter with its draft KV cache and, optionally, its own lm_head.
pub struct CliDrafter<'d, B: Backend> {
    model: &'d DraftModel<B>,
    kv: Option<DraftKv<B>>,
    taps: Vec<i32>,
    head: Option<Weight<B>>,
}

impl<'d, B: Backend> CliDrafter<'d, B> {
    /// `head`: the lm_head the drafter uses instead of the target's (`None`: the target's).
    pub fn new(model: &'d DraftModel<B>, head: Option<Weight<B>>) -> Result<Self> {
        let taps = model
            .cfg
            .target_layer_ids
            .iter()
            .map(|&l| i32::try_from(l).with_context(|| format!("tap layer {l} out of range")))
            .collect::<Result<Vec<_>>>()?;
        Ok(CliDrafter {
            model,
            kv: None,
            taps,
            head,
        })
    }

    fn kv(&mut self) -> dflash_spec_round::Result<&mut DraftKv<B>> {
        self.kv
            .as_mut()
            .ok_or_else(|| SpecError::Protocol("drafter used before reset".into()))
    }
}

impl<B: Backend> Drafter<B> for CliDrafter<'_, B> {
    fn tap_layers(&self) -> &[i32] {
        &self.taps
    }

    fn hidden(&self) -> usize {
        self.model.cfg.hidden_size
    }

    fn n_drafts(&self) -> usize {
        self.model.n_drafts(self.model.cfg.block_size)
    }

    fn reset(&mut self, be: &B, ctx_cap: usize) -> dflash_spec_round::Result<()> {
        match &mut self.kv {
            Some(kv) if kv.capacity() >= ctx_cap => kv.clear(),
            _ => self.kv = Some(self.model.new_kv(be, ctx_cap).map_err(draft_err)?),
        }
        Ok(())
    }

    fn ctx_len(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.pos0() + kv.len())
    }

    fn ingest(&mut self, be: &B, taps: &B::Buf, rows: usize) -> dflash_spec_round::Result<()> {
        let pos0 = self.ctx_len();
        let model = self.model;
        model
            .ingest(be, self.kv()?, taps, rows, pos0)
            .map_err(draft_err)
    }

    fn draft(
        &mut self,
        be: &B,
        target: &dyn Target<B>,
        anchor: u32,
        pos: usize,
        n: usize,
        opts: DraftOptions,
    ) -> dflash_spec_round::Result<Vec<u32>> {
        let model = self.model;
        let o = DmOptions {
            markov: opts.markov,
            emb_scale: opts.emb_scale,
            block_len: None,
            max_drafts: Some(n),
            return_logits: false,
        };
        let kv = self
            .kv
            .as_mut()
            .ok_or_else(|| SpecError::Protocol("drafter used before reset".into()))?;
        let lend = Lend {
            target,
            head: self.head.as_ref(),
        };
        let out = model
            .draft(be, kv, &lend, anchor, pos, &o)
            .map_err(draft_err)?;
        Ok(out.tokens)
    }
}

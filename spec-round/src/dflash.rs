//! The DFlash / DSpark drafter of `dflash-draft-model` behind [`crate::Drafter`], and any
//! [`Target`] as the drafter's [`TargetLend`].

use dflash_backend::{Backend, BackendError, Weight};
use dflash_draft_model::{DraftOptions as DmOptions, Drafter as DraftModel, TargetLend};
use dflash_kv::DraftKv;

use crate::{DraftOptions, Drafter, Result, SpecError, Target};

/// A [`Target`] lending its embedding rows and lm_head to the drafter.
pub struct TargetAsLend<'a, B: Backend>(pub &'a dyn Target<B>);

impl<B: Backend> TargetLend<B> for TargetAsLend<'_, B> {
    fn hidden_size(&self) -> usize {
        self.0.info().hidden
    }
    fn vocab_size(&self) -> usize {
        self.0.info().vocab
    }
    fn embed(
        &self,
        be: &B,
        ids: &[u32],
        out: &mut B::Buf,
    ) -> std::result::Result<(), BackendError> {
        self.0.embed_rows(be, ids, out)
    }
    fn lm_head(&self) -> &Weight<B> {
        self.0.lm_head()
    }
}

/// A [`Target`] lending its embedding rows, with another lm_head in place of its own.
struct TargetWithHead<'a, B: Backend> {
    target: &'a dyn Target<B>,
    head: &'a Weight<B>,
}

impl<B: Backend> TargetLend<B> for TargetWithHead<'_, B> {
    fn hidden_size(&self) -> usize {
        self.target.info().hidden
    }
    fn vocab_size(&self) -> usize {
        self.target.info().vocab
    }
    fn embed(
        &self,
        be: &B,
        ids: &[u32],
        out: &mut B::Buf,
    ) -> std::result::Result<(), BackendError> {
        self.target.embed_rows(be, ids, out)
    }
    fn lm_head(&self) -> &Weight<B> {
        self.head
    }
}

fn draft_err(e: dflash_draft_model::DraftError) -> SpecError {
    SpecError::Drafter(Box::new(e))
}

/// A loaded drafter with its draft KV cache, as the round engine drives it.
pub struct DflashDrafter<'d, B: Backend> {
    model: &'d DraftModel<B>,
    kv: Option<DraftKv<B>>,
    taps: Vec<i32>,
    /// The drafter's own lm_head, used instead of the target's (see [`DflashDrafter::with_head`]).
    head: Option<Weight<B>>,
}

impl<'d, B: Backend> DflashDrafter<'d, B> {
    /// Wrap a drafter; its cache is allocated by the session (`reset`).
    pub fn new(model: &'d DraftModel<B>) -> Result<Self> {
        let taps = model
            .cfg
            .target_layer_ids
            .iter()
            .map(|&l| {
                i32::try_from(l).map_err(|_| SpecError::TapLayer {
                    layer: i32::MAX,
                    n_layers: 0,
                    max: l,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DflashDrafter {
            model,
            kv: None,
            taps,
            head: None,
        })
    }

    /// Draft with `head` (`[vocab, hidden]`, e.g. a cheaper re-encoding of the target's) instead
    /// of the target's lm_head; the embedding rows still come from the target. The drafter's
    /// logits only decide what it proposes, so this changes speed and acceptance, never the
    /// committed stream. Its shape is checked against the target at each draft step.
    pub fn with_head(mut self, head: Weight<B>) -> Self {
        self.head = Some(head);
        self
    }

    /// The wrapped drafter.
    pub fn model(&self) -> &DraftModel<B> {
        self.model
    }

    fn kv(&mut self) -> Result<&mut DraftKv<B>> {
        self.kv
            .as_mut()
            .ok_or_else(|| SpecError::Protocol("drafter used before reset".into()))
    }
}

impl<B: Backend> Drafter<B> for DflashDrafter<'_, B> {
    fn tap_layers(&self) -> &[i32] {
        &self.taps
    }

    fn hidden(&self) -> usize {
        self.model.cfg.hidden_size
    }

    fn n_drafts(&self) -> usize {
        self.model.n_drafts(self.model.cfg.block_size)
    }

    fn reset(&mut self, be: &B, ctx_cap: usize) -> Result<()> {
        match &mut self.kv {
            Some(kv) if kv.capacity() >= ctx_cap => kv.clear(),
            _ => self.kv = Some(self.model.new_kv(be, ctx_cap).map_err(draft_err)?),
        }
        Ok(())
    }

    fn ctx_len(&self) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.pos0() + kv.len())
    }

    fn ingest(&mut self, be: &B, taps: &B::Buf, rows: usize) -> Result<()> {
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
    ) -> Result<Vec<u32>> {
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
        let out = match &self.head {
            Some(head) => model.draft(be, kv, &TargetWithHead { target, head }, anchor, pos, &o),
            None => model.draft(be, kv, &TargetAsLend(target), anchor, pos, &o),
        }
        .map_err(draft_err)?;
        Ok(out.tokens)
    }
}

//! The drafter forward, written once over [`Backend`].
//!
//! * [`Drafter::ctx_features`]: `hidden_norm(fc(taps))` for context rows.
//! * [`Drafter::ingest`]: context rows into the draft KV cache (k_proj / v_proj of the
//!   features, k_norm, RoPE at their absolute positions), in chunks of [`INGEST_CHUNK`] rows.
//! * [`Drafter::forward_cached`]: the block forward over the cached context (the round's hot
//!   path); block K/V are written after the cache's committed rows and never committed.
//! * [`Drafter::forward_full`]: the uncached forward over (taps, block) from scratch, for tests.
//! * [`Drafter::draft`]: block forward + lm_head rows + argmax or the Markov chain +
//!   confidence logits: the step the round engine calls.
//!
//! Invariant of the cached path: the draft cache holds K/V for exactly the positions whose
//! target features are known, so at the start of a round `kv.len() == start`, the position of
//! the anchor (the last committed token, whose features are not yet known).

use dflash_backend::{
    AttnOp, AttnParams, Backend, KvCacheRows, KvStorage, LayerTail, QkNormRope, TailScratch, Weight,
};
use dflash_kv::{DraftKv, KvShape};

use crate::config::{LayerKind, RowLayout};
use crate::error::{DraftError, Result};
use crate::model::{DraftLayer, Drafter};

/// Context rows are ingested this many at a time (bounds the scratch memory of long prompts).
pub const INGEST_CHUNK: usize = 256;

/// What the drafter borrows from its target: the embedding rows and the lm_head.
///
/// Object safe, so a round engine can hand over `&dyn TargetLend<B>`.
pub trait TargetLend<B: Backend> {
    /// The target's hidden size (must equal the drafter's).
    fn hidden_size(&self) -> usize;
    /// Rows of the embedding table / lm_head.
    fn vocab_size(&self) -> usize;
    /// `out[i, :] = E[ids[i], :]` (unscaled), `out` holds at least `ids.len() * hidden` values.
    fn embed(&self, be: &B, ids: &[u32], out: &mut B::Buf) -> dflash_backend::Result<()>;
    /// The lm_head, `[vocab, hidden]`.
    fn lm_head(&self) -> &Weight<B>;
}

/// A target lend made of two resident weights (an embedding table and an lm_head).
pub struct LentWeights<B: Backend> {
    /// `[vocab, hidden]`
    pub embed: Weight<B>,
    /// `[vocab, hidden]`
    pub lm_head: Weight<B>,
}

impl<B: Backend> LentWeights<B> {
    /// Check that both weights are `[vocab, hidden]` with the same shape.
    pub fn new(embed: Weight<B>, lm_head: Weight<B>) -> Result<Self> {
        if embed.rows != lm_head.rows || embed.cols != lm_head.cols {
            return Err(DraftError::Shape {
                tensor: lm_head.name.clone(),
                expected: vec![embed.rows, embed.cols],
                found: vec![lm_head.rows, lm_head.cols],
            });
        }
        Ok(LentWeights { embed, lm_head })
    }
}

impl<B: Backend> TargetLend<B> for LentWeights<B> {
    fn hidden_size(&self) -> usize {
        self.embed.cols
    }
    fn vocab_size(&self) -> usize {
        self.embed.rows
    }
    fn embed(&self, be: &B, ids: &[u32], out: &mut B::Buf) -> dflash_backend::Result<()> {
        be.gather_rows(&self.embed, ids, out)
    }
    fn lm_head(&self) -> &Weight<B> {
        &self.lm_head
    }
}

/// Options of one draft step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftOptions {
    /// Run the Markov chain when the drafter has a Markov head.
    pub markov: bool,
    /// Multiplier on the borrowed embedding rows (gemma-class targets: `sqrt(hidden)`).
    pub emb_scale: f32,
    /// Block rows to run (anchor + masks), `1..=block_size`; `None` = `block_size`.
    /// Fewer rows is a different (shorter) block, not a truncation of the full one.
    pub block_len: Option<usize>,
    /// Compute at most this many drafts (lm_head rows); `None` = all the block yields.
    pub max_drafts: Option<usize>,
    /// Return the draft logits (`[n, vocab]`, after the Markov bias when it ran).
    pub return_logits: bool,
}

impl Default for DraftOptions {
    fn default() -> Self {
        DraftOptions {
            markov: true,
            emb_scale: 1.0,
            block_len: None,
            max_drafts: None,
            return_logits: false,
        }
    }
}

/// Result of one draft step.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftOutput {
    /// Draft tokens for positions `start + 1 ..` (greedy; after the Markov chain if it ran).
    pub tokens: Vec<u32>,
    /// Pre-sigmoid confidence logits, one per draft, when the drafter has a confidence head.
    pub confidence: Option<Vec<f32>>,
    /// `[tokens.len(), vocab]` draft logits, when asked for.
    pub logits: Option<Vec<f32>>,
}

/// Output of the uncached forward.
pub struct FullForward<B: Backend> {
    /// `[ctx, hidden]` context features.
    pub ctx_features: B::Buf,
    /// `[b, hidden]` after the final norm.
    pub final_hidden: B::Buf,
    /// Residual stream after each layer (`[b, hidden]` each), when traced.
    pub layer_outs: Vec<Vec<f32>>,
}

/// Activation buffers of one block forward of `b` rows (exact sizes: the row-wise ops
/// normalise whole buffers).
pub(crate) struct Scratch<B: Backend> {
    b: usize,
    /// residual stream `[b, d]`
    x: B::Buf,
    /// normed rows `[b, d]` (input and post-attention norms)
    xn: B::Buf,
    q0: B::Buf,
    k0: B::Buf,
    v: B::Buf,
    q: B::Buf,
    k: B::Buf,
    attn: B::Buf,
    /// o_proj and down_proj outputs `[b, d]`
    o: B::Buf,
    g: B::Buf,
    u: B::Buf,
    a: B::Buf,
    /// final-normed rows `[b, d]`
    hidden: B::Buf,
    /// [`Drafter::draft`]'s lm_head logits `[n, vocab]`, kept between calls.
    logits: Option<B::Buf>,
}

/// [`Drafter::ingest`]'s buffers for chunks of `n` rows.
pub(crate) struct IngestScratch<B: Backend> {
    n: usize,
    /// fc output `[n, hidden]`.
    fc: B::Buf,
    /// the context features `hidden_norm(fc)` (a backend may leave them unwritten).
    feats: B::Buf,
    /// per layer: k before its norm, then v, `[n, kv_dim]` each.
    kv: Vec<B::Buf>,
    k_tmp: B::Buf,
    q0: B::Buf,
    q: B::Buf,
}

impl<B: Backend> IngestScratch<B> {
    fn new(be: &B, cfg: &crate::config::DraftConfig, layers: usize, n: usize) -> Result<Self> {
        let (d, kvd) = (cfg.hidden_size, cfg.kv_dim());
        Ok(IngestScratch {
            n,
            fc: be.zeros(n * d)?,
            feats: be.zeros(n * d)?,
            kv: (0..2 * layers)
                .map(|_| be.zeros(n * kvd))
                .collect::<std::result::Result<_, _>>()?,
            k_tmp: be.zeros(n * kvd)?,
            q0: be.zeros(0)?,
            q: be.zeros(0)?,
        })
    }
}

impl<B: Backend> Scratch<B> {
    fn new(be: &B, cfg: &crate::config::DraftConfig, b: usize) -> Result<Self> {
        let (d, qd, kvd, inter) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        Ok(Scratch {
            b,
            x: be.zeros(b * d)?,
            xn: be.zeros(b * d)?,
            q0: be.zeros(b * qd)?,
            k0: be.zeros(b * kvd)?,
            v: be.zeros(b * kvd)?,
            q: be.zeros(b * qd)?,
            k: be.zeros(b * kvd)?,
            attn: be.zeros(b * qd)?,
            o: be.zeros(b * d)?,
            g: be.zeros(b * inter)?,
            u: be.zeros(b * inter)?,
            a: be.zeros(b * inter)?,
            hidden: be.zeros(b * d)?,
            logits: None,
        })
    }
}

fn attn_params<B: Backend>(
    d: &Drafter<B>,
    layer: usize,
    n_q: usize,
    n_kv: usize,
    q_pos0: usize,
    kv_pos0: usize,
) -> AttnParams {
    let c = &d.cfg;
    let (causal, window) = match c.layer_kinds[layer] {
        LayerKind::Full => (false, None),
        LayerKind::Sliding { window } => (true, Some(window)),
    };
    AttnParams {
        n_q,
        n_kv,
        n_heads: c.num_attention_heads,
        n_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        q_pos0,
        kv_pos0,
        causal,
        window,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
    }
}

impl<B: Backend> Drafter<B> {
    /// The shape of a draft KV cache for this drafter holding `capacity` context positions.
    pub fn kv_shape(&self, capacity: usize) -> KvShape {
        KvShape {
            n_layers: self.layers.len(),
            n_kv_heads: self.cfg.num_key_value_heads,
            head_dim: self.cfg.head_dim,
            capacity,
            block: self.cfg.block_size,
        }
    }

    /// A fresh draft KV cache for `capacity` context positions.
    pub fn new_kv(&self, be: &B, capacity: usize) -> Result<DraftKv<B>> {
        Ok(DraftKv::with_storage(
            be,
            self.kv_shape(capacity),
            self.kv_storage,
        )?)
    }

    /// Number of drafts a block of `block_len` rows yields in this drafter's layout.
    pub fn n_drafts(&self, block_len: usize) -> usize {
        self.layout.n_drafts(block_len)
    }

    fn check_taps(&self, be: &B, taps: &B::Buf, rows: usize) -> Result<()> {
        let w = self.cfg.n_taps() * self.cfg.hidden_size;
        let need = rows
            .checked_mul(w)
            .ok_or_else(|| DraftError::Invalid(format!("{rows} tap rows overflow")))?;
        if be.len(taps) < need {
            return Err(DraftError::mismatch(
                format!("taps buffer values for {rows} rows of width {w}"),
                need,
                be.len(taps),
            ));
        }
        Ok(())
    }

    fn check_lend(&self, lend: &dyn TargetLend<B>) -> Result<()> {
        if lend.hidden_size() != self.cfg.hidden_size {
            return Err(DraftError::mismatch(
                "target hidden size",
                self.cfg.hidden_size,
                lend.hidden_size(),
            ));
        }
        let lm = lend.lm_head();
        if lm.cols != self.cfg.hidden_size || lm.rows != lend.vocab_size() {
            return Err(DraftError::Shape {
                tensor: lm.name.clone(),
                expected: vec![lend.vocab_size(), self.cfg.hidden_size],
                found: vec![lm.rows, lm.cols],
            });
        }
        Ok(())
    }

    /// Context features `hidden_norm(fc(taps))` for `rows` tap rows (`[rows, n_taps*hidden]`).
    pub fn ctx_features(&self, be: &B, taps: &B::Buf, rows: usize) -> Result<B::Buf> {
        self.check_taps(be, taps, rows)?;
        let d = self.cfg.hidden_size;
        let mut fc = be.zeros(rows * d)?;
        be.matmul(taps, rows, &self.fc, &mut fc)?;
        let mut out = be.zeros(rows * d)?;
        be.rms_norm(&fc, &self.hidden_norm, d, self.cfg.rms_norm_eps, &mut out)?;
        Ok(out)
    }

    /// K (normed, roped at `pos0..`) and V of `rows` context feature rows for `layer`.
    fn ctx_kv(
        &self,
        be: &B,
        layer: usize,
        feats: &B::Buf,
        rows: usize,
        pos0: usize,
    ) -> Result<(B::Buf, B::Buf)> {
        let c = &self.cfg;
        let l = &self.layers[layer];
        let kvd = c.kv_dim();
        let mut k0 = be.zeros(rows * kvd)?;
        be.matmul(feats, rows, &l.wk, &mut k0)?;
        let mut v = be.zeros(rows * kvd)?;
        be.matmul(feats, rows, &l.wv, &mut v)?;
        let mut k = be.zeros(rows * kvd)?;
        be.rms_norm(&k0, &l.k_norm, c.head_dim, c.rms_norm_eps, &mut k)?;
        be.rope(
            &mut k,
            rows,
            c.num_key_value_heads,
            c.head_dim,
            pos0,
            &self.ropes[layer],
        )?;
        Ok((k, v))
    }

    /// Ingest `rows` context rows (`taps` = `[rows, n_taps*hidden]`, positions `pos0..`) into
    /// the draft KV cache, [`INGEST_CHUNK`] rows at a time. `pos0` must equal `kv.len()`:
    /// context rows go in committed order with no gap.
    pub fn ingest(
        &self,
        be: &B,
        kv: &mut DraftKv<B>,
        taps: &B::Buf,
        rows: usize,
        pos0: usize,
    ) -> Result<()> {
        let next = kv.pos0() + kv.len();
        if pos0 != next {
            return Err(DraftError::mismatch(
                "ingest position (the cache's next position)",
                next,
                pos0,
            ));
        }
        self.check_kv(kv)?;
        self.check_taps(be, taps, rows)?;
        let (d, w) = (
            self.cfg.hidden_size,
            self.cfg.n_taps() * self.cfg.hidden_size,
        );
        // Per chunk: fc, then the context features' norm feeding every layer's k / v
        // projections in one call ([`Backend::norm_matmul_many`]), then per layer K normed +
        // roped and V written straight into the cache ([`Backend::qk_norm_rope_kv`] with no q
        // rows): the bits of `ctx_features` + `ctx_kv` + `append`. A round's ingest (at most
        // a block of rows) uses the drafter's buffers for that row count, kept between calls
        // (a concurrent caller gets its own); a longer one allocates its own.
        let n_max = rows.min(INGEST_CHUNK);
        let layers = self.layers.len();
        let mut guard = self.ingest_scratch.try_lock().ok();
        let mut local = None;
        let s: &mut IngestScratch<B> = match guard.as_deref_mut() {
            Some(slots) if rows <= self.cfg.block_size => {
                if slots.len() <= rows {
                    slots.resize_with(rows + 1, || None);
                }
                let slot = &mut slots[rows];
                if slot.is_none() {
                    *slot = Some(IngestScratch::new(be, &self.cfg, layers, rows)?);
                }
                slot.as_mut()
                    .ok_or_else(|| DraftError::Invalid("ingest scratch".into()))?
            }
            _ => local.insert(IngestScratch::new(be, &self.cfg, layers, n_max)?),
        };
        let ws: Vec<&Weight<B>> = self.layers.iter().flat_map(|l| [&l.wk, &l.wv]).collect();
        let mut done = 0;
        while done < rows {
            let n = (rows - done).min(INGEST_CHUNK);
            let chunk = if done == 0 && n == rows {
                None
            } else {
                let mut t = be.zeros(n * w)?;
                be.copy(taps, done * w, &mut t, 0, n * w)?;
                Some(t)
            };
            kv.ensure_room(n)?;
            // A shorter last chunk: buffers of its own size (the fused norm takes whole ones).
            let mut short = None;
            let s = if n == s.n {
                &mut *s
            } else {
                short.insert(IngestScratch::new(be, &self.cfg, layers, n)?)
            };
            be.matmul(chunk.as_ref().unwrap_or(taps), n, &self.fc, &mut s.fc)?;
            let mut outs: Vec<&mut B::Buf> = s.kv.iter_mut().collect();
            be.norm_matmul_many(
                &s.fc,
                &self.hidden_norm,
                d,
                self.cfg.rms_norm_eps,
                &mut s.feats,
                n,
                &ws,
                &mut outs,
            )?;
            for layer in 0..layers {
                let storage = kv.storage();
                let (kc, vc, row0) = kv.append_rows_mut(layer, n)?;
                let cache = KvCacheRows {
                    k: kc,
                    v: vc,
                    row0,
                    storage,
                };
                let qk = self.qk_norm_rope(layer, pos0 + done);
                let (k0, v) = (&s.kv[2 * layer], &s.kv[2 * layer + 1]);
                be.qk_norm_rope_kv(&s.q0, k0, v, 0, n, &qk, &mut s.q, &mut s.k_tmp, cache)?;
            }
            kv.commit(n)?;
            done += n;
        }
        Ok(())
    }

    fn check_kv(&self, kv: &DraftKv<B>) -> Result<()> {
        if kv.n_layers() != self.layers.len() {
            return Err(DraftError::mismatch(
                "draft KV cache layers",
                self.layers.len(),
                kv.n_layers(),
            ));
        }
        if kv.row_width() != self.cfg.kv_dim() {
            return Err(DraftError::mismatch(
                "draft KV cache row width",
                self.cfg.kv_dim(),
                kv.row_width(),
            ));
        }
        if kv.block() < self.cfg.block_size {
            return Err(DraftError::mismatch(
                "draft KV cache block rows",
                self.cfg.block_size,
                kv.block(),
            ));
        }
        if kv.storage() != self.kv_storage {
            return Err(DraftError::Invalid(format!(
                "draft KV cache stored as {:?}, the drafter was loaded for {:?} (make it with Drafter::new_kv)",
                kv.storage(),
                self.kv_storage
            )));
        }
        Ok(())
    }

    /// Embed the block `[anchor, MASK x (b-1)]` into `x` (`[b, hidden]`), scaled, with the
    /// learned mask embedding for rows 1.. when the checkpoint has one.
    fn embed_block(
        &self,
        be: &B,
        lend: &dyn TargetLend<B>,
        tokens: &[u32],
        emb_scale: f32,
        x: &mut B::Buf,
    ) -> Result<()> {
        let d = self.cfg.hidden_size;
        let vocab = lend.vocab_size();
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(DraftError::TokenOutOfRange { id, vocab });
        }
        lend.embed(be, tokens, x)?;
        if emb_scale != 1.0 {
            be.scale(x, emb_scale)?;
        }
        if let Some(m) = &self.mask_embedding {
            for r in 1..tokens.len() {
                be.copy(m, 0, x, r * d, d)?;
            }
        }
        Ok(())
    }

    /// The block tokens `[anchor, MASK x (len-1)]`.
    pub fn block_tokens(&self, anchor: u32, len: usize) -> Vec<u32> {
        let mut t = vec![self.cfg.mask_token_id; len];
        if let Some(f) = t.first_mut() {
            *f = anchor;
        }
        t
    }

    /// One layer over the block rows `s.x` (`[b, hidden]`, in place). `attend` receives the
    /// scratch with the projections `s.q0` (its first `rows` rows), `s.k0` and `s.v` (all `b`
    /// block rows), normalises and rotates them (with [`Drafter::qk_norm_rope`]), places K and V
    /// and runs the attention of the `rows` queries and the rest of the layer
    /// ([`Drafter::attention_tail`]).
    ///
    /// Only the first `rows` rows (`1..=b`) are carried through the query side, the o
    /// projection and the MLP; K and V still cover the whole block. The last layer of a draft
    /// step runs with `rows` = the rows whose drafts are wanted: the other rows only ever feed
    /// later layers' keys and values, and every op is per-row deterministic, so the kept rows
    /// are bit for bit those of the full block. Rows `rows..b` of `s.x` are left stale.
    #[allow(clippy::type_complexity)]
    fn block_layer(
        &self,
        be: &B,
        li: usize,
        s: &mut Scratch<B>,
        rows: usize,
        attend: &mut dyn FnMut(usize, usize, &mut Scratch<B>) -> Result<()>,
    ) -> Result<()> {
        let c = &self.cfg;
        let l: &DraftLayer<B> = &self.layers[li];
        let (d, eps, b) = (c.hidden_size, c.rms_norm_eps, s.b);
        if rows == 0 || rows > b {
            return Err(DraftError::Invalid(format!(
                "layer {li}: {rows} query rows for a block of {b}"
            )));
        }
        // The backend's fused sequences (the norm writing the projections' input, one launch
        // for several matrices, the layer tail below, where the backend has them): the bits
        // of the separate ops.
        if rows == b {
            be.norm_matmul_many(
                &s.x,
                &l.ln_in,
                d,
                eps,
                &mut s.xn,
                b,
                &[&l.wq, &l.wk, &l.wv],
                &mut [&mut s.q0, &mut s.k0, &mut s.v],
            )?;
        } else {
            be.rms_norm(&s.x, &l.ln_in, d, eps, &mut s.xn)?;
            be.matmul(&s.xn, rows, &l.wq, &mut s.q0)?;
            be.matmul_many(&s.xn, b, &[&l.wk, &l.wv], &mut [&mut s.k0, &mut s.v])?;
        }
        // The attention and the rest of the layer ([`Drafter::attention_tail`]).
        attend(li, rows, s)
    }

    /// Layer `li`'s per-head q/k norms and RoPE for block rows at positions `pos0..`
    /// ([`Backend::qk_norm_rope_kv`]).
    fn qk_norm_rope(&self, li: usize, pos0: usize) -> QkNormRope<'_, B> {
        let (c, l) = (&self.cfg, &self.layers[li]);
        QkNormRope {
            q_norm: &l.q_norm,
            k_norm: &l.k_norm,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            eps: c.rms_norm_eps,
            pos0,
            rope: &self.ropes[li],
        }
    }

    fn final_norm(&self, be: &B, s: &mut Scratch<B>) -> Result<()> {
        let d = self.cfg.hidden_size;
        be.rms_norm(&s.x, &self.norm, d, self.cfg.rms_norm_eps, &mut s.hidden)?;
        Ok(())
    }

    fn check_block(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() || tokens.len() > self.cfg.block_size {
            return Err(DraftError::Invalid(format!(
                "block of {} rows; allowed 1..={}",
                tokens.len(),
                self.cfg.block_size
            )));
        }
        Ok(())
    }

    /// Layer `li`'s attention of the `p.n_q` query rows in `s.q` over K / V stored as
    /// `storage` says (an f16 cache through [`Backend::attention_fast_kv16`], an f32 one
    /// through [`Backend::attention_fast`] when loaded with
    /// [`crate::LoadOptions::fast_attention`], else the exact op) into `s.attn`, then the o
    /// projection + residual, post-norm and SwiGLU MLP + residual on `s.x`: one
    /// [`Backend::attention_layer_tail`] (the backend may run it as fewer launches, with the
    /// same bits).
    #[allow(clippy::too_many_arguments)]
    fn attention_tail(
        &self,
        be: &B,
        li: usize,
        k: &B::Buf,
        v: &B::Buf,
        storage: KvStorage,
        p: &AttnParams,
        s: &mut Scratch<B>,
    ) -> Result<()> {
        let op = match storage {
            KvStorage::F16 => AttnOp::FastKv16,
            KvStorage::F32 if self.fast_attention => AttnOp::Fast,
            KvStorage::F32 => AttnOp::Exact,
        };
        let l = &self.layers[li];
        let tail = LayerTail {
            wo: &l.wo,
            post_norm: &l.ln_post,
            eps: self.cfg.rms_norm_eps,
            w_gate: &l.w_gate,
            w_up: &l.w_up,
            w_down: &l.w_down,
        };
        let Scratch {
            x,
            xn,
            q,
            attn,
            o,
            g,
            u,
            a,
            ..
        } = s;
        let scratch = TailScratch {
            o,
            xn,
            gate: g,
            up: u,
            act: a,
        };
        be.attention_layer_tail(q, k, v, p, op, attn, x, &tail, scratch)?;
        Ok(())
    }

    /// The block forward over the cached context (the seed's `forward_round`).
    ///
    /// `tokens` is the block (normally [`Drafter::block_tokens`]), sitting at positions
    /// `kv.len()..kv.len() + tokens.len()` (plus `kv.pos0()`). Block K/V are written after the
    /// committed rows and left uncommitted (the cache length does not change). Returns the
    /// final-normed hidden rows `[b, hidden]`.
    pub fn forward_cached(
        &self,
        be: &B,
        kv: &mut DraftKv<B>,
        lend: &dyn TargetLend<B>,
        tokens: &[u32],
        emb_scale: f32,
    ) -> Result<B::Buf> {
        self.check_block(tokens)?;
        let mut s = Scratch::new(be, &self.cfg, tokens.len())?;
        self.forward_cached_in(be, kv, lend, tokens, emb_scale, tokens.len(), &mut s, true)?;
        Ok(s.hidden)
    }

    /// [`Drafter::forward_cached`] into the buffers of `s`: the final rows `0..out_rows` in
    /// `s.hidden` (the last layer runs its query side, o projection and MLP on those rows only;
    /// the rows past them are not final); with `final_norm` false the last layer's output
    /// stays in `s.x`, not normed.
    #[allow(clippy::too_many_arguments)]
    fn forward_cached_in(
        &self,
        be: &B,
        kv: &mut DraftKv<B>,
        lend: &dyn TargetLend<B>,
        tokens: &[u32],
        emb_scale: f32,
        out_rows: usize,
        s: &mut Scratch<B>,
        final_norm: bool,
    ) -> Result<()> {
        self.check_block(tokens)?;
        self.check_kv(kv)?;
        self.check_lend(lend)?;
        let b = tokens.len();
        if s.b != b {
            return Err(DraftError::mismatch("scratch rows", b, s.b));
        }
        let (kv_pos0, n_ctx) = (kv.pos0(), kv.len());
        let start = kv_pos0 + n_ctx;
        self.embed_block(be, lend, tokens, emb_scale, &mut s.x)?;
        let n_layers = self.layers.len();
        for li in 0..n_layers {
            let mut attend = |li: usize, n_q: usize, s: &mut Scratch<B>| -> Result<()> {
                // The block's K and V straight into the cache after the context.
                let storage = kv.storage();
                let (kc, vc, row0) = kv.block_rows_mut(li, b)?;
                let cache = KvCacheRows {
                    k: kc,
                    v: vc,
                    row0,
                    storage,
                };
                let qk = self.qk_norm_rope(li, start);
                be.qk_norm_rope_kv(&s.q0, &s.k0, &s.v, n_q, b, &qk, &mut s.q, &mut s.k, cache)?;
                let (kb, vb) = kv.layer(li)?;
                let p = attn_params(self, li, n_q, n_ctx + b, start, kv_pos0);
                self.attention_tail(be, li, kb, vb, storage, &p, s)?;
                Ok(())
            };
            let rows = if li + 1 == n_layers { out_rows } else { b };
            self.block_layer(be, li, s, rows, &mut attend)?;
        }
        if final_norm {
            self.final_norm(be, s)?;
        }
        Ok(())
    }

    /// The uncached forward from scratch: context rows `0..ctx` from `taps`
    /// (`[ctx, n_taps*hidden]`), the block at positions `ctx..ctx+b`. With `trace`, the residual
    /// stream after every layer is returned too.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_full(
        &self,
        be: &B,
        lend: &dyn TargetLend<B>,
        taps: &B::Buf,
        ctx: usize,
        tokens: &[u32],
        emb_scale: f32,
        trace: bool,
    ) -> Result<FullForward<B>> {
        self.check_block(tokens)?;
        self.check_lend(lend)?;
        let c = &self.cfg;
        let b = tokens.len();
        let kvd = c.kv_dim();
        let feats = self.ctx_features(be, taps, ctx)?;
        let mut s = Scratch::new(be, c, b)?;
        self.embed_block(be, lend, tokens, emb_scale, &mut s.x)?;
        let mut layer_outs = Vec::new();
        for li in 0..self.layers.len() {
            let (kc, vc) = self.ctx_kv(be, li, &feats, ctx, 0)?;
            let mut attend = |li: usize, n_q: usize, s: &mut Scratch<B>| -> Result<()> {
                // [context K / V ; the block's], the block's written by the norm + RoPE op,
                // stored as the cache would store them.
                let st = self.kv_storage;
                let mut ka = be.zeros(st.slots((ctx + b) * kvd))?;
                let mut va = be.zeros(st.slots((ctx + b) * kvd))?;
                match st {
                    KvStorage::F32 => {
                        be.copy(&kc, 0, &mut ka, 0, ctx * kvd)?;
                        be.copy(&vc, 0, &mut va, 0, ctx * kvd)?;
                    }
                    KvStorage::F16 => {
                        be.f16_pack(&kc, &mut ka, 0, ctx * kvd)?;
                        be.f16_pack(&vc, &mut va, 0, ctx * kvd)?;
                    }
                }
                let cache = KvCacheRows {
                    k: &mut ka,
                    v: &mut va,
                    row0: ctx,
                    storage: st,
                };
                let qk = self.qk_norm_rope(li, ctx);
                be.qk_norm_rope_kv(&s.q0, &s.k0, &s.v, n_q, b, &qk, &mut s.q, &mut s.k, cache)?;
                let p = attn_params(self, li, n_q, ctx + b, ctx, 0);
                self.attention_tail(be, li, &ka, &va, st, &p, s)?;
                Ok(())
            };
            self.block_layer(be, li, &mut s, b, &mut attend)?;
            if trace {
                layer_outs.push(be.download(&s.x)?);
            }
        }
        self.final_norm(be, &mut s)?;
        Ok(FullForward {
            ctx_features: feats,
            final_hidden: s.hidden,
            layer_outs,
        })
    }

    /// Draft logits through the target's lm_head for `n` rows of `hidden` starting at block
    /// row `row0`: `[n, vocab]`.
    pub fn draft_logits(
        &self,
        be: &B,
        lend: &dyn TargetLend<B>,
        hidden: &B::Buf,
        row0: usize,
        n: usize,
    ) -> Result<B::Buf> {
        let d = self.cfg.hidden_size;
        let vocab = lend.vocab_size();
        let mut rows = be.zeros(n * d)?;
        be.copy(hidden, row0 * d, &mut rows, 0, n * d)?;
        let mut logits = be.zeros(n * vocab)?;
        be.matmul(&rows, n, lend.lm_head(), &mut logits)?;
        Ok(logits)
    }

    /// Confidence logits `w · [z_k ; W1[prev_k]] + b` for the `n` draft rows starting at block
    /// row `row0`, with `prev = [anchor, tokens[..n-1]]`. `None` without a confidence head.
    pub fn confidence_logits(
        &self,
        be: &B,
        hidden: &B::Buf,
        row0: usize,
        anchor: u32,
        tokens: &[u32],
    ) -> Result<Option<Vec<f32>>> {
        let Some(ch) = &self.confidence else {
            return Ok(None);
        };
        let d = self.cfg.hidden_size;
        let n = tokens.len();
        if n == 0 {
            return Ok(Some(Vec::new()));
        }
        let in_dim = ch.w.cols;
        let mut inp = be.zeros(n * in_dim)?;
        be.copy2d(hidden, row0 * d, d, &mut inp, 0, in_dim, n, d)?;
        if ch.with_markov {
            let m = self.markov.as_ref().ok_or_else(|| {
                DraftError::Invalid("confidence head with Markov input but no Markov head".into())
            })?;
            let mut prev = Vec::with_capacity(n);
            prev.push(anchor);
            prev.extend_from_slice(&tokens[..n - 1]);
            if let Some(&id) = prev.iter().find(|&&t| t as usize >= m.w1.rows) {
                return Err(DraftError::TokenOutOfRange {
                    id,
                    vocab: m.w1.rows,
                });
            }
            let mut e = be.zeros(n * m.rank)?;
            be.gather_rows(&m.w1, &prev, &mut e)?;
            be.copy2d(&e, 0, m.rank, &mut inp, d, in_dim, n, m.rank)?;
        }
        let mut out = be.zeros(n)?;
        be.matmul(&inp, n, &ch.w, &mut out)?;
        let mut v = be.download(&out)?;
        v.truncate(n);
        for x in &mut v {
            *x += ch.bias;
        }
        Ok(Some(v))
    }

    /// Turn final-normed block rows into drafts: lm_head rows, argmax or the Markov chain,
    /// confidence logits.
    pub fn drafts_from_hidden(
        &self,
        be: &B,
        lend: &dyn TargetLend<B>,
        hidden: &B::Buf,
        block_len: usize,
        anchor: u32,
        opts: &DraftOptions,
    ) -> Result<DraftOutput> {
        let Some((row0, n)) = self.draft_rows(lend, block_len, anchor, opts)? else {
            return Ok(self.no_drafts(opts));
        };
        let mut logits = self.draft_logits(be, lend, hidden, row0, n)?;
        self.finish_drafts(be, lend, hidden, &mut logits, row0, n, anchor, opts)
    }

    /// The first block row with a draft and the number of drafts (`None`: no drafts), after
    /// checking the lent weights and the anchor.
    fn draft_rows(
        &self,
        lend: &dyn TargetLend<B>,
        block_len: usize,
        anchor: u32,
        opts: &DraftOptions,
    ) -> Result<Option<(usize, usize)>> {
        self.check_lend(lend)?;
        let vocab = lend.vocab_size();
        if anchor as usize >= vocab {
            return Err(DraftError::TokenOutOfRange { id: anchor, vocab });
        }
        let mut n = self.layout.n_drafts(block_len);
        if let Some(m) = opts.max_drafts {
            n = n.min(m);
        }
        Ok((n > 0).then(|| (self.layout.first_row(), n)))
    }

    fn no_drafts(&self, opts: &DraftOptions) -> DraftOutput {
        DraftOutput {
            tokens: Vec::new(),
            confidence: self.confidence.as_ref().map(|_| Vec::new()),
            logits: opts.return_logits.then(Vec::new),
        }
    }

    /// Drafts from the `n` rows of lm_head logits: argmax or the Markov chain, the confidence
    /// logits from the final-normed `hidden` rows `row0..`, the logits on the host if asked.
    #[allow(clippy::too_many_arguments)]
    fn finish_drafts(
        &self,
        be: &B,
        lend: &dyn TargetLend<B>,
        hidden: &B::Buf,
        logits: &mut B::Buf,
        row0: usize,
        n: usize,
        anchor: u32,
        opts: &DraftOptions,
    ) -> Result<DraftOutput> {
        let vocab = lend.vocab_size();
        let tokens = match (&self.markov, opts.markov) {
            (Some(m), true) => {
                if m.w2.rows != vocab {
                    return Err(DraftError::mismatch(
                        "Markov head vocabulary",
                        vocab,
                        m.w2.rows,
                    ));
                }
                be.markov_chain(logits, n, vocab, anchor, &m.w1, &m.w2)?
            }
            _ => be.argmax_rows(logits, 0, n, vocab)?,
        };
        let confidence = self.confidence_logits(be, hidden, row0, anchor, &tokens)?;
        let logits = if opts.return_logits {
            let mut v = be.download(logits)?;
            v.truncate(n * vocab);
            Some(v)
        } else {
            None
        };
        Ok(DraftOutput {
            tokens,
            confidence,
            logits,
        })
    }

    /// One draft step over the cached context: block `[anchor, MASK x (b-1)]` at positions
    /// `start..start+b`, where `start == kv.len()` (the invariant: the cache holds every
    /// position whose target features are known, and nothing else). The cache length is
    /// unchanged afterwards.
    pub fn draft(
        &self,
        be: &B,
        kv: &mut DraftKv<B>,
        lend: &dyn TargetLend<B>,
        anchor: u32,
        start: usize,
        opts: &DraftOptions,
    ) -> Result<DraftOutput> {
        let next = kv.pos0() + kv.len();
        if start != next {
            return Err(DraftError::mismatch(
                "block start (the draft cache's next position)",
                next,
                start,
            ));
        }
        let b = opts.block_len.unwrap_or(self.cfg.block_size);
        let tokens = self.block_tokens(anchor, b);
        self.check_block(&tokens)?;
        // Reuse the drafter's scratch when it is free (a concurrent caller gets its own).
        let mut guard = self.scratch.try_lock().ok();
        let mut local = None;
        let s: &mut Scratch<B> = match guard.as_deref_mut() {
            Some(slot) => {
                if slot.as_ref().is_none_or(|s| s.b != b) {
                    *slot = Some(Scratch::new(be, &self.cfg, b)?);
                }
                slot.as_mut()
                    .ok_or_else(|| DraftError::Invalid("scratch".into()))?
            }
            None => local.insert(Scratch::new(be, &self.cfg, b)?),
        };
        // Only the rows whose drafts are computed need the last layer's query side and MLP.
        let mut n = self.layout.n_drafts(b);
        if let Some(m) = opts.max_drafts {
            n = n.min(m);
        }
        let out_rows = (self.layout.first_row() + n).clamp(1, b);
        self.forward_cached_in(be, kv, lend, &tokens, opts.emb_scale, out_rows, s, false)?;
        let Some((row0, n)) = self.draft_rows(lend, b, anchor, opts)? else {
            return Ok(self.no_drafts(opts));
        };
        // The lm_head rows from the residual stream: their final norm and the lm_head as one
        // backend call (which may skip writing the normed rows), the logits buffer kept
        // between calls. The confidence head reads the final-normed rows: written then.
        let (d, vocab) = (self.cfg.hidden_size, lend.vocab_size());
        let mut logits = match s.logits.take() {
            Some(l) if be.len(&l) == n * vocab => l,
            _ => be.zeros(n * vocab)?,
        };
        be.norm_rows_matmul(
            &s.x,
            &self.norm,
            d,
            self.cfg.rms_norm_eps,
            row0,
            n,
            &mut s.hidden,
            lend.lm_head(),
            &mut logits,
        )?;
        if self.confidence.is_some() {
            self.final_norm(be, s)?;
        }
        let out = self.finish_drafts(be, lend, &s.hidden, &mut logits, row0, n, anchor, opts);
        s.logits = Some(logits);
        out
    }

    /// The row layout in use.
    pub fn row_layout(&self) -> RowLayout {
        self.layout
    }
}

//! The hybrid model: forward, recurrent / conv / KV state, and the three rollback arms.

use std::path::Path;

use dflash_backend::{
    f16_pair_values, AttnParams, Backend, DeltaParams, GatedNorm, KvCacheRows, KvStorage,
    LayerTail, QkNormRope, TailScratch, Weight,
};
use dflash_spec_round::{Forward, RollbackArm, SpecError, Target, TargetInfo};

use super::config::{HybridConfig, LayerKind, MoeConfig};
use super::weights::{
    load_weights, Mixer, Mlp, ModelWeights, MoeWeights, SwiGlu, TensorNames, TensorSource,
};
use crate::checkpoint::Checkpoint;
use crate::error::{check_forward_input, check_verify_start};
use crate::qwen3::{LoadOptions, LogitRows};
use crate::{Result, TargetError};

/// What a layer's mixer leaves for its output projection.
enum Mixed<'a, B: Backend> {
    /// The attention layer's attention and its output gate, before the gate.
    SigmoidGated { att: B::Buf, gate: B::Buf },
    /// A Gated DeltaNet layer's recurrence output and gate, before its gated norm (`norm`,
    /// one weight per head dim), which the layer's tail runs.
    Gated {
        core: B::Buf,
        z: B::Buf,
        norm: &'a B::Buf,
    },
}

/// Per-layer cached state.
enum LayerState<B: Backend> {
    /// Gated DeltaNet: conv window `[kernel - 1, channels]` (oldest first) and recurrent state
    /// `[n_v_heads, dk, dv]`.
    Linear { conv: B::Buf, rec: B::Buf },
    /// Full attention: K (normed, roped) and V, `[cap, n_kv_heads·head_dim]` each.
    Full { k: B::Buf, v: B::Buf },
}

/// Host copies of K/V rows per layer (`None` for linear layers).
type KvRows = Vec<Option<(Vec<f32>, Vec<f32>)>>;

/// Copies of the linear layers' states (`None` for full-attention layers).
type LinearStates<B> = Vec<Option<(<B as Backend>::Buf, <B as Backend>::Buf)>>;

/// The verify whose rows are not committed yet.
struct Pending<B: Backend> {
    start: usize,
    tokens: Vec<u32>,
    arm: RollbackArm,
    /// Per linear layer: conv states `[t, kernel - 1, channels]` and recurrent states
    /// `[t, n_v_heads, dk, dv]` after each verified token (Stash and Gate).
    stash: LinearStates<B>,
    /// Per linear layer: the states before the verify (Replay and Gate).
    snapshot: LinearStates<B>,
}

/// A Qwen3.5 / Qwen3-Next hybrid target (Gated DeltaNet + gated full attention, dense or
/// sparse-MoE MLP) with its caches, as transformers 5.17 computes it (`Qwen3_5ForCausalLM`,
/// the text part of `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForCausalLM`,
/// `Qwen3NextForCausalLM`).
///
/// The linear layers run the recurrent form of the gated delta rule for every row count
/// (transformers runs the chunked form for prefills; the two agree to f32 rounding).
pub struct HybridTarget<B: Backend> {
    cfg: HybridConfig,
    w: ModelWeights<B>,
    states: Vec<LayerState<B>>,
    /// How the full-attention layers' K / V caches store their values.
    kv: KvStorage,
    cap: usize,
    pos: usize,
    arm: RollbackArm,
    pending: Option<Pending<B>>,
}

fn dup<B: Backend>(be: &B, src: &B::Buf) -> Result<B::Buf> {
    let n = be.len(src);
    let mut d = be.zeros(n)?;
    be.copy(src, 0, &mut d, 0, n)?;
    Ok(d)
}

impl<B: Backend> HybridTarget<B> {
    /// Load an HF checkpoint directory: the text-only causal LM (`model.layers.*`) or the
    /// text part of a vision-language checkpoint (nested `text_config`,
    /// `model.language_model.layers.*`; the vision tower is ignored).
    pub fn load(be: &B, dir: impl AsRef<Path>, opts: LoadOptions) -> Result<Self> {
        Self::from_checkpoint(be, &Checkpoint::open(dir)?, opts)
    }

    /// As [`HybridTarget::load`], from an open checkpoint.
    pub fn from_checkpoint(be: &B, ck: &Checkpoint, opts: LoadOptions) -> Result<Self> {
        let cfg = HybridConfig::from_json(&ck.config_path(), ck.config())?;
        let names = TensorNames::detect(ck)?;
        Self::from_source(be, cfg, ck, &names, opts)
    }

    /// Build from any tensor source with an explicit name layout.
    pub fn from_source(
        be: &B,
        cfg: HybridConfig,
        src: &dyn TensorSource,
        names: &TensorNames,
        opts: LoadOptions,
    ) -> Result<Self> {
        cfg.validate("hybrid config")?;
        let w = load_weights(be, src, &cfg, names, opts.precision)?;
        let cap = opts.ctx_cap.unwrap_or(cfg.max_positions.min(4096));
        if cap == 0 {
            return Err(SpecError::Config("context cap of 0 positions".into()).into());
        }
        let kvw = cfg.n_kv_heads * cfg.head_dim;
        let kv = opts.kv_storage;
        crate::qwen3::check_kv_width(kv, kvw)?;
        let mut states = Vec::with_capacity(cfg.n_layers);
        for kind in &cfg.layer_kinds {
            states.push(match kind {
                LayerKind::Linear => LayerState::Linear {
                    conv: be.zeros((cfg.conv_kernel - 1) * cfg.conv_channels())?,
                    rec: be.zeros(cfg.lin_v_heads * cfg.lin_dk * cfg.lin_dv)?,
                },
                LayerKind::Full => LayerState::Full {
                    k: be.zeros(kv.slots(cap * kvw))?,
                    v: be.zeros(kv.slots(cap * kvw))?,
                },
            });
        }
        Ok(HybridTarget {
            cfg,
            w,
            states,
            kv,
            cap,
            pos: 0,
            arm: RollbackArm::default(),
            pending: None,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &HybridConfig {
        &self.cfg
    }

    /// The rollback arm of the following verifies.
    pub fn rollback_arm(&self) -> RollbackArm {
        self.arm
    }

    /// The output projection (the embedding when tied).
    pub fn head(&self) -> &Weight<B> {
        self.w.lm_head.as_ref().unwrap_or(&self.w.embed)
    }

    /// The embedding table.
    pub fn embedding(&self) -> &Weight<B> {
        &self.w.embed
    }

    /// Committed positions.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Forget everything: zero the recurrent and conv states, empty the KV caches.
    pub fn reset(&mut self, be: &B) -> Result<()> {
        self.pos = 0;
        self.pending = None;
        for s in &mut self.states {
            if let LayerState::Linear { conv, rec } = s {
                *conv = be.zeros(be.len(conv))?;
                *rec = be.zeros(be.len(rec))?;
            }
        }
        Ok(())
    }

    /// Plain (non-speculative) step: run `tokens` at the committed length and commit them all.
    /// Taps as in [`Target::verify`] (`-1 ..= n_layers - 1`), logits for `rows`.
    pub fn run(
        &mut self,
        be: &B,
        tokens: &[u32],
        taps: &[i32],
        rows: LogitRows,
    ) -> Result<Forward<B>> {
        if self.pending.is_some() {
            return Err(SpecError::Protocol("run with an uncommitted verify".into()).into());
        }
        let (f, _) = self.forward(be, tokens, self.pos, taps, rows, false, self.cfg.n_layers)?;
        self.pos += tokens.len();
        Ok(f)
    }

    /// Host copies of every linear layer's (conv, recurrent) state, in layer order
    /// (diagnostics and tests).
    pub fn linear_states(&self, be: &B) -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
        self.states
            .iter()
            .filter_map(|s| match s {
                LayerState::Linear { conv, rec } => Some((conv, rec)),
                LayerState::Full { .. } => None,
            })
            .map(|(c, r)| Ok((be.download(c)?, be.download(r)?)))
            .collect()
    }

    /// Layers a replay must run: through the last linear-attention layer.
    fn replay_depth(&self) -> usize {
        self.cfg
            .layer_kinds
            .iter()
            .rposition(|k| *k == LayerKind::Linear)
            .map_or(0, |i| i + 1)
    }

    /// Run `tokens` at `start..start + t` through the first `depth` layers, updating the
    /// linear states in place and writing K/V at those positions. With `stash`, also return
    /// the per-token linear states. Logits and taps only when `depth == n_layers`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        be: &B,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        rows: LogitRows,
        stash: bool,
        depth: usize,
    ) -> Result<(Forward<B>, LinearStates<B>)> {
        let c = &self.cfg;
        let t = tokens.len();
        let d = c.hidden;
        check_forward_input(tokens, start, self.cap, c.vocab, taps, c.n_layers)?;
        let nt = taps.len();
        let mut tap_buf = if nt > 0 && depth == c.n_layers {
            Some(be.scratch(t * nt * d)?)
        } else {
            None
        };
        let write_taps = |be: &B, layer: i32, x: &B::Buf, tb: &mut Option<B::Buf>| -> Result<()> {
            if let Some(tb) = tb.as_mut() {
                for (j, _) in taps.iter().enumerate().filter(|(_, &l)| l == layer) {
                    be.copy2d(x, 0, d, tb, j * d, nt * d, t, d)?;
                }
            }
            Ok(())
        };

        // Shapes.
        let (nk, nv, dk, dv) = (c.lin_k_heads, c.lin_v_heads, c.lin_dk, c.lin_dv);
        let (vd, ch, kern) = (nv * dv, c.conv_channels(), c.conv_kernel);
        let sl = kern - 1;
        let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let (qw, kvw) = (nh * hd, nkv * hd);
        let eps = c.rms_eps;
        let delta = DeltaParams {
            t,
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            qk_l2norm: true,
            // transformers: query / sqrt(dk) (recurrent) or query * dk**-0.5 (chunked).
            q_scale: (1.0 / (dk as f64).sqrt()) as f32,
        };

        // Activations each op writes whole before any read: `Backend::scratch` (no zero
        // fill). So are the taps (every tap layer is in -1..n_layers, checked above, and the
        // taps exist only for a forward through every layer) and the stashes (the conv and
        // recurrent kernels write every token's state whole when they stash).
        let mut x = be.scratch(t * d)?;
        be.gather_rows(&self.w.embed, tokens, &mut x)?;
        write_taps(be, -1, &x, &mut tap_buf)?;
        let mut h = be.scratch(t * d)?;
        let mut o = be.scratch(t * d)?;
        let mut stashes: LinearStates<B> = Vec::with_capacity(depth);
        // The dense MLP's scratch (`Backend::layer_tail`).
        let dense = self
            .w
            .layers
            .iter()
            .take(depth)
            .any(|l| matches!(l.mlp, Mlp::Dense(_)));
        let mlp_len = if dense { t * c.intermediate } else { 0 };
        let (mut mg, mut mu, mut ma) = (
            be.scratch(mlp_len)?,
            be.scratch(mlp_len)?,
            be.scratch(mlp_len)?,
        );

        for (li, (layer, state)) in self
            .w
            .layers
            .iter()
            .zip(self.states.iter_mut())
            .enumerate()
            .take(depth)
        {
            // Each mixer leaves the rows of its output projection in `mixed`, before their last
            // op (the attention's output gate, a Gated DeltaNet layer's gated norm), which runs
            // with the layer's tail; the norm before the mixer and its projections of x run in
            // one call (the fused launches where the backend has them, the bits of the
            // separate ops).
            let (mixed, wo) = match (&layer.mixer, state) {
                (Mixer::Linear(lw), LayerState::Linear { conv, rec }) => {
                    let mut qkv = be.scratch(t * ch)?;
                    let mut z = be.scratch(t * vd)?;
                    let mut bb = be.scratch(t * nv)?;
                    let mut aa = be.scratch(t * nv)?;
                    be.norm_matmul_many(
                        &x,
                        &layer.in_norm,
                        d,
                        eps,
                        &mut h,
                        t,
                        &[&lw.qkv, &lw.z, &lw.b, &lw.a],
                        &mut [&mut qkv, &mut z, &mut bb, &mut aa],
                    )?;
                    let mut conv_out = be.scratch(t * ch)?;
                    let mut conv_stash = if stash {
                        Some(be.scratch(t * sl * ch)?)
                    } else {
                        None
                    };
                    be.causal_conv1d(
                        &qkv,
                        t,
                        ch,
                        kern,
                        &lw.conv,
                        conv,
                        &mut conv_out,
                        conv_stash.as_mut(),
                    )?;
                    let mut core = be.scratch(t * vd)?;
                    let mut rec_stash = if stash {
                        Some(be.scratch(t * nv * dk * dv)?)
                    } else {
                        None
                    };
                    // The recurrence reads q / k / v from the conv's rows and computes its
                    // gates from `a` / `b` (one launch where the backend fuses it).
                    be.gated_delta_rule_qkv(
                        &conv_out,
                        &aa,
                        &bb,
                        &lw.a_log,
                        &lw.dt_bias,
                        &delta,
                        rec,
                        &mut core,
                        rec_stash.as_mut(),
                    )?;
                    stashes.push(conv_stash.zip(rec_stash));
                    let gated: Mixed<'_, B> = Mixed::Gated {
                        core,
                        z,
                        norm: &lw.norm,
                    };
                    (gated, &lw.out)
                }
                (Mixer::Full(fw), LayerState::Full { k: kc, v: vc }) => {
                    let mut q = be.scratch(t * qw)?;
                    let mut gate = be.scratch(t * qw)?;
                    let mut k = be.scratch(t * kvw)?;
                    let mut v = be.scratch(t * kvw)?;
                    be.norm_matmul_many(
                        &x,
                        &layer.in_norm,
                        d,
                        eps,
                        &mut h,
                        t,
                        &[&fw.q, &fw.gate, &fw.k, &fw.v],
                        &mut [&mut q, &mut gate, &mut k, &mut v],
                    )?;
                    let mut qn = be.scratch(t * qw)?;
                    let mut kn = be.scratch(t * kvw)?;
                    // Per-head norms + RoPE, K and V into the caches at `start` (one launch
                    // where the backend fuses it).
                    let qk = QkNormRope {
                        q_norm: &fw.q_norm,
                        k_norm: &fw.k_norm,
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        eps,
                        pos0: start,
                        rope: &c.rope,
                    };
                    let cache = KvCacheRows {
                        k: kc,
                        v: vc,
                        row0: start,
                        storage: self.kv,
                    };
                    be.qk_norm_rope_kv(&q, &k, &v, t, t, &qk, &mut qn, &mut kn, cache)?;
                    let p = AttnParams {
                        n_q: t,
                        n_kv: start + t,
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        q_pos0: start,
                        kv_pos0: 0,
                        causal: true,
                        window: None,
                        scale: (1.0 / (hd as f64).sqrt()) as f32,
                    };
                    let mut att = be.scratch(t * qw)?;
                    crate::qwen3::attn_op(self.kv).run(be, &qn, kc, vc, &p, &mut att)?;
                    stashes.push(None);
                    (Mixed::SigmoidGated { att, gate }, &fw.o)
                }
                _ => {
                    return Err(TargetError::Unsupported(format!(
                    "layer {li}: weights and state disagree on the layer kind (internal invariant)"
                )))
                }
            };
            // x += mixed W_o; h = norm(x); x += MLP(h).
            match &layer.mlp {
                Mlp::Dense(m) => {
                    let tail = LayerTail {
                        wo,
                        post_norm: &layer.post_norm,
                        eps,
                        w_gate: &m.gate,
                        w_up: &m.up,
                        w_down: &m.down,
                    };
                    let scratch = TailScratch {
                        o: &mut o,
                        xn: &mut h,
                        gate: &mut mg,
                        up: &mut mu,
                        act: &mut ma,
                    };
                    match mixed {
                        // The output gate or the gated norm, then the tail (one launch fewer
                        // where the backend has the gate or the norm write the o projection's
                        // x).
                        Mixed::SigmoidGated { mut att, gate } => {
                            be.sigmoid_gate_layer_tail(&mut att, &gate, t, &mut x, &tail, scratch)?
                        }
                        Mixed::Gated { core, z, norm } => {
                            let mut normed = be.scratch(t * vd)?;
                            let g = GatedNorm {
                                x: &core,
                                z: &z,
                                w: norm,
                                dim: dv,
                                eps,
                            };
                            be.gated_norm_layer_tail(&g, &mut normed, t, &mut x, &tail, scratch)?;
                        }
                    }
                }
                Mlp::Moe(m) => {
                    let moe = c.moe.ok_or_else(|| {
                        TargetError::Unsupported(format!(
                            "layer {li}: MoE weights without an MoE shape"
                        ))
                    })?;
                    let rows = match mixed {
                        Mixed::SigmoidGated { mut att, gate } => {
                            be.mul_sigmoid(&mut att, &gate)?;
                            att
                        }
                        Mixed::Gated { core, z, norm } => {
                            let mut normed = be.scratch(t * vd)?;
                            be.rms_norm_gated(&core, &z, norm, dv, eps, &mut normed)?;
                            normed
                        }
                    };
                    be.matmul(&rows, t, wo, &mut o)?;
                    be.add_rms_norm(&mut x, &o, &layer.post_norm, t, d, eps, &mut h)?;
                    moe_forward(be, &h, t, d, m, &moe, &mut o)?;
                    be.add_assign(&mut x, 0, &o, t * d)?;
                }
            }
            write_taps(be, li as i32, &x, &mut tap_buf)?;
        }

        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        let rows = if depth == c.n_layers {
            rows
        } else {
            LogitRows::None
        };
        let (argmax, logits) = match rows {
            LogitRows::None => (Vec::new(), None),
            LogitRows::Last => {
                let mut last = be.zeros(d)?;
                be.copy(&x, (t - 1) * d, &mut last, 0, d)?;
                let mut ln = be.zeros(d)?;
                be.rms_norm(&last, &self.w.norm, d, eps, &mut ln)?;
                let mut lg = be.zeros(c.vocab)?;
                be.matmul(&ln, 1, head, &mut lg)?;
                (be.argmax_rows(&lg, 0, 1, c.vocab)?, Some(lg))
            }
            LogitRows::All => {
                be.rms_norm(&x, &self.w.norm, d, eps, &mut h)?;
                let mut lg = be.scratch(t * c.vocab)?;
                be.matmul(&h, t, head, &mut lg)?;
                (be.argmax_rows(&lg, 0, t, c.vocab)?, Some(lg))
            }
        };
        Ok((
            Forward {
                argmax,
                logits,
                taps: tap_buf,
            },
            stashes,
        ))
    }

    /// Copies of the current linear states.
    fn snapshot(&self, be: &B) -> Result<LinearStates<B>> {
        self.states
            .iter()
            .map(|s| match s {
                LayerState::Linear { conv, rec } => Ok(Some((dup(be, conv)?, dup(be, rec)?))),
                LayerState::Full { .. } => Ok(None),
            })
            .collect()
    }

    /// Put `snap` back as the linear states.
    fn restore_snapshot(&mut self, be: &B, snap: &LinearStates<B>) -> Result<()> {
        for (s, sn) in self.states.iter_mut().zip(snap) {
            if let (LayerState::Linear { conv, rec }, Some((sc, sr))) = (s, sn) {
                be.copy(sc, 0, conv, 0, be.len(conv))?;
                be.copy(sr, 0, rec, 0, be.len(rec))?;
            }
        }
        Ok(())
    }

    /// Set every linear state to the one stashed after verified row `row`.
    fn restore_from_stash(&mut self, be: &B, stash: &LinearStates<B>, row: usize) -> Result<()> {
        for (li, (s, st)) in self.states.iter_mut().zip(stash).enumerate() {
            if let LayerState::Linear { conv, rec } = s {
                let (sc, sr) = st.as_ref().ok_or_else(|| {
                    SpecError::Protocol(format!("no stashed state for linear layer {li}"))
                })?;
                let (nc, nr) = (be.len(conv), be.len(rec));
                be.copy(sc, row * nc, conv, 0, nc)?;
                be.copy(sr, row * nr, rec, 0, nr)?;
            }
        }
        Ok(())
    }

    /// Host copies of the K/V rows `start..start + n` of the full layers below `depth`.
    fn kv_rows(&self, be: &B, start: usize, n: usize, depth: usize) -> Result<KvRows> {
        let kvw = self.cfg.n_kv_heads * self.cfg.head_dim;
        self.states
            .iter()
            .take(depth)
            .map(|s| match s {
                LayerState::Full { k, v } => {
                    let (k, v) = (be.download(k)?, be.download(v)?);
                    // The values of rows start..start + n (an f16 cache unpacked: two per
                    // slot, rows of an even width).
                    let rows = |c: Vec<f32>| -> Vec<f32> {
                        match self.kv {
                            KvStorage::F32 => c[start * kvw..(start + n) * kvw].to_vec(),
                            KvStorage::F16 => c[start * kvw / 2..(start + n) * kvw / 2]
                                .iter()
                                .flat_map(|s| f16_pair_values(s.to_bits()))
                                .collect(),
                        }
                    };
                    Ok(Some((rows(k), rows(v))))
                }
                LayerState::Linear { .. } => Ok(None),
            })
            .collect()
    }

    /// Undo the rows of the pending verify past `keep` under its arm.
    fn rollback(&mut self, be: &B, p: &Pending<B>, keep: usize) -> Result<()> {
        let t = p.tokens.len();
        let depth = self.replay_depth();
        match p.arm {
            RollbackArm::Stash => {
                if keep < t {
                    self.restore_from_stash(be, &p.stash, keep - 1)?;
                }
            }
            RollbackArm::Replay => {
                if keep < t && depth > 0 {
                    self.restore_snapshot(be, &p.snapshot)?;
                    self.forward(
                        be,
                        &p.tokens[..keep],
                        p.start,
                        &[],
                        LogitRows::None,
                        false,
                        depth,
                    )?;
                }
            }
            RollbackArm::Gate => {
                if keep < t {
                    self.restore_from_stash(be, &p.stash, keep - 1)?;
                }
                let by_stash = self.linear_states(be)?;
                let kv_verify = self.kv_rows(be, p.start, keep, depth)?;
                self.restore_snapshot(be, &p.snapshot)?;
                if depth > 0 {
                    self.forward(
                        be,
                        &p.tokens[..keep],
                        p.start,
                        &[],
                        LogitRows::None,
                        false,
                        depth,
                    )?;
                }
                let by_replay = self.linear_states(be)?;
                let kv_replay = self.kv_rows(be, p.start, keep, depth)?;
                let linear_layers: Vec<usize> = (0..self.cfg.n_layers)
                    .filter(|&i| self.cfg.layer_kinds[i] == LayerKind::Linear)
                    .collect();
                for ((li, (sc, sr)), (rc, rr)) in
                    linear_layers.iter().zip(&by_stash).zip(&by_replay)
                {
                    gate_compare(*li, "conv state", sc, rc, keep, t)?;
                    gate_compare(*li, "recurrent state", sr, rr, keep, t)?;
                }
                for (li, (a, b)) in kv_verify.iter().zip(&kv_replay).enumerate() {
                    if let (Some((ka, va)), Some((kb, vb))) = (a, b) {
                        gate_compare(li, "K cache rows", ka, kb, keep, t)?;
                        gate_compare(li, "V cache rows", va, vb, keep, t)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `out[..t·d] = down(silu(gate(x)) ⊙ up(x))` for `t` rows.
fn swiglu<B: Backend>(be: &B, x: &B::Buf, t: usize, m: &SwiGlu<B>, out: &mut B::Buf) -> Result<()> {
    let n = m.gate.rows;
    let mut g = be.zeros(t * n)?;
    let mut u = be.zeros(t * n)?;
    let mut a = be.zeros(t * n)?;
    be.matmul(x, t, &m.gate, &mut g)?;
    be.matmul(x, t, &m.up, &mut u)?;
    be.silu_mul(&g, &u, &mut a)?;
    be.matmul(&a, t, &m.down, out)?;
    Ok(())
}

/// The sparse MoE block as transformers computes it (`Qwen3NextSparseMoeBlock`,
/// `Qwen3_5MoeSparseMoeBlock`): router softmax in f32, top-k (ties: lower expert index),
/// optional renormalisation, each routed expert's output scaled by its weight and summed in
/// ascending expert order, plus `sigmoid(shared_expert_gate · x) ⊙ shared_expert(x)`.
/// Rows are routed independently (the router runs on the host), so a row's value does not
/// depend on the other rows of the call.
fn moe_forward<B: Backend>(
    be: &B,
    x: &B::Buf,
    t: usize,
    d: usize,
    m: &MoeWeights<B>,
    cfg: &MoeConfig,
    out: &mut B::Buf,
) -> Result<()> {
    let ne = cfg.n_experts;
    let mut logits = be.zeros(t * ne)?;
    be.matmul(x, t, &m.router, &mut logits)?;
    let logits = be.download(&logits)?;
    // Shared expert and its gate over all rows.
    let mut shared = be.zeros(t * d)?;
    swiglu(be, x, t, &m.shared, &mut shared)?;
    let mut sg = be.zeros(t)?;
    be.matmul(x, t, &m.shared_gate, &mut sg)?;
    let sg = be.download(&sg)?;
    let gate_rows: Vec<f32> = sg.iter().flat_map(|&g| std::iter::repeat_n(g, d)).collect();
    be.mul_sigmoid(&mut shared, &be.upload(&gate_rows)?)?;
    // Routed experts, one row at a time.
    let mut routed = be.zeros(t * d)?;
    let mut xr = be.zeros(d)?;
    let mut yr = be.zeros(d)?;
    for r in 0..t {
        let row = &logits[r * ne..(r + 1) * ne];
        let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ex: Vec<f32> = row.iter().map(|&l| (l - mx).exp()).collect();
        let sum: f32 = ex.iter().sum();
        let probs: Vec<f32> = ex.iter().map(|&e| e / sum).collect();
        let mut order: Vec<usize> = (0..ne).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let mut top: Vec<(usize, f32)> =
            order[..cfg.top_k].iter().map(|&e| (e, probs[e])).collect();
        if cfg.norm_topk {
            let s: f32 = top.iter().map(|p| p.1).sum();
            for p in &mut top {
                p.1 /= s;
            }
        }
        top.sort_by_key(|p| p.0);
        be.copy(x, r * d, &mut xr, 0, d)?;
        for (e, w) in top {
            swiglu(be, &xr, 1, &m.experts[e], &mut yr)?;
            be.scale(&mut yr, w)?;
            be.add_assign(&mut routed, r * d, &yr, d)?;
        }
    }
    be.add_assign(&mut routed, 0, &shared, t * d)?;
    be.copy(&routed, 0, out, 0, t * d)?;
    Ok(())
}

/// Bit-for-bit comparison of the Gate arm.
fn gate_compare(
    layer: usize,
    what: &str,
    stash: &[f32],
    replay: &[f32],
    keep: usize,
    t: usize,
) -> Result<()> {
    if stash.len() != replay.len() {
        return Err(SpecError::Gate(format!(
            "layer {layer} {what}: {} values after stash restore, {} after replay",
            stash.len(),
            replay.len()
        ))
        .into());
    }
    if let Some(i) = stash
        .iter()
        .zip(replay)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        return Err(SpecError::Gate(format!(
            "layer {layer} {what} differs at index {i} after keeping {keep} of {t} rows: stash {:e}, replay {:e}",
            stash[i], replay[i]
        ))
        .into());
    }
    Ok(())
}

impl<B: Backend> Target<B> for HybridTarget<B> {
    fn info(&self) -> TargetInfo {
        TargetInfo {
            n_layers: self.cfg.n_layers,
            hidden: self.cfg.hidden,
            vocab: self.cfg.vocab,
            ctx_cap: self.cap,
        }
    }

    fn pos(&self) -> usize {
        self.pos
    }

    fn set_rollback(&mut self, arm: RollbackArm) {
        self.arm = arm;
    }

    fn prime(
        &mut self,
        be: &B,
        prompt: &[u32],
        taps: &[i32],
    ) -> dflash_spec_round::Result<Forward<B>> {
        self.info().check_taps(taps)?;
        if prompt.is_empty() {
            return Err(SpecError::EmptyPrompt);
        }
        self.reset(be)?;
        let f = self.run(be, prompt, taps, LogitRows::Last)?;
        Ok(Forward { logits: None, ..f })
    }

    fn verify(
        &mut self,
        be: &B,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        want_logits: bool,
    ) -> dflash_spec_round::Result<Forward<B>> {
        self.info().check_taps(taps)?;
        check_verify_start(start, self.pos, self.pending.is_some())?;
        let arm = self.arm;
        let snapshot = match arm {
            RollbackArm::Replay | RollbackArm::Gate => self.snapshot(be)?,
            RollbackArm::Stash => Vec::new(),
        };
        let want_stash = matches!(arm, RollbackArm::Stash | RollbackArm::Gate);
        let (mut f, stash) = self.forward(
            be,
            tokens,
            start,
            taps,
            LogitRows::All,
            want_stash,
            self.cfg.n_layers,
        )?;
        if !want_logits {
            f.logits = None;
        }
        self.pending = Some(Pending {
            start,
            tokens: tokens.to_vec(),
            arm,
            stash,
            snapshot,
        });
        Ok(f)
    }

    fn commit(&mut self, be: &B, keep: usize) -> dflash_spec_round::Result<()> {
        let t = match &self.pending {
            None => return Err(SpecError::Protocol("commit without a verify".into())),
            Some(p) => p.tokens.len(),
        };
        if keep == 0 || keep > t {
            // The verify stays pending: a valid commit can still follow.
            return Err(SpecError::Protocol(format!(
                "commit of {keep} rows after a verify of {t}"
            )));
        }
        let p = self
            .pending
            .take()
            .ok_or_else(|| SpecError::Protocol("commit without a verify".into()))?;
        self.rollback(be, &p, keep)?;
        self.pos = p.start + keep;
        Ok(())
    }

    fn embed_rows(&self, be: &B, ids: &[u32], out: &mut B::Buf) -> dflash_backend::Result<()> {
        be.gather_rows(&self.w.embed, ids, out)
    }

    fn lm_head(&self) -> &Weight<B> {
        self.head()
    }
}

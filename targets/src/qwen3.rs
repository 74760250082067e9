//! Qwen3 dense (`Qwen3ForCausalLM`) as transformers implements it, generic over a backend,
//! with a KV cache whose rollback is a truncation.

use std::sync::Arc;

use dflash_backend::{
    AttnOp, AttnParams, Backend, KvCacheRows, KvStorage, LayerTail, QkNormRope, RopeSpec,
    TailScratch, Weight, WeightFormat,
};
use dflash_spec_round::{Forward, RollbackArm, SpecError, Target, TargetInfo};

use crate::checkpoint::Checkpoint;
use crate::config::Cfg;
use crate::error::{check_forward_input, check_verify_start};
use crate::{Result, TargetError};

/// The shape of a Qwen3 dense model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen3Config {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope: RopeSpec,
    pub tie_embeddings: bool,
    /// Attention window per layer (`None` = full causal attention).
    pub windows: Vec<Option<usize>>,
    pub max_positions: usize,
}

impl Qwen3Config {
    /// Parse a transformers `Qwen3Config` object.
    pub fn from_cfg(c: &Cfg) -> Result<Self> {
        let hidden = c.usize("hidden_size")?;
        let n_heads = c.usize("num_attention_heads")?;
        let n_layers = c.usize("num_hidden_layers")?;
        let head_dim = c.usize_or("head_dim", 128)?;
        if c.bool_or("attention_bias", false)? {
            return Err(TargetError::Unsupported(format!(
                "{}: attention_bias = true is not supported",
                c.path
            )));
        }
        let act = c.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(TargetError::Unsupported(format!(
                "{}: hidden_act `{act}` (only silu)",
                c.path
            )));
        }
        let use_sw = c.bool_or("use_sliding_window", false)?;
        let sw = if use_sw {
            Some(c.usize_or("sliding_window", 4096)?)
        } else {
            None
        };
        let max_window_layers = c.usize_or("max_window_layers", n_layers)?;
        let types = c.strings("layer_types")?.unwrap_or_else(|| {
            (0..n_layers)
                .map(|i| {
                    if sw.is_some() && i >= max_window_layers {
                        "sliding_attention".to_string()
                    } else {
                        "full_attention".to_string()
                    }
                })
                .collect()
        });
        if types.len() != n_layers {
            return Err(TargetError::Config {
                path: c.path.clone(),
                msg: format!(
                    "layer_types has {} entries, num_hidden_layers is {n_layers}",
                    types.len()
                ),
            });
        }
        let windows = types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(sw),
                "full_attention" => Ok(None),
                other => Err(TargetError::Unsupported(format!(
                    "{}: layer type `{other}` in a dense Qwen3",
                    c.path
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Qwen3Config {
            vocab: c.usize("vocab_size")?,
            hidden,
            intermediate: c.usize("intermediate_size")?,
            n_layers,
            n_heads,
            n_kv_heads: c.usize_or("num_key_value_heads", n_heads)?,
            head_dim,
            rms_eps: c.f64_or("rms_norm_eps", 1e-6)? as f32,
            rope: c.rope(head_dim)?,
            tie_embeddings: c.bool_or("tie_word_embeddings", false)?,
            windows,
            max_positions: c.usize_or("max_position_embeddings", 32768)?,
        })
    }
}

impl Qwen3Config {
    /// Internal consistency: one window entry per layer, whole GQA groups, a rotary width
    /// that fits the head, positive sizes.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(TargetError::Unsupported(format!("Qwen3 config: {msg}")));
        if self.windows.len() != self.n_layers {
            return bad(format!(
                "{} window entries for {} layers",
                self.windows.len(),
                self.n_layers
            ));
        }
        if [
            self.vocab,
            self.hidden,
            self.intermediate,
            self.n_layers,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
        ]
        .contains(&0)
        {
            return bad("a size is zero".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.rope.rot_dim() > self.head_dim {
            return bad(format!(
                "rotary width {} exceeds head_dim {}",
                self.rope.rot_dim(),
                self.head_dim
            ));
        }
        if self.windows.contains(&Some(0)) {
            return bad("a sliding window of 0".into());
        }
        Ok(())
    }
}

/// Load options of a reference target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Re-encode every 2-D weight into this format (`None`: keep the file's format).
    pub precision: Option<WeightFormat>,
    /// KV / state capacity in positions (`None`: `max_position_embeddings`, at most 4096).
    pub ctx_cap: Option<usize>,
    /// How the full-attention layers' K / V caches store their values. [`KvStorage::F32`]
    /// (the default): the exact attention. [`KvStorage::F16`]: half the cache memory and its
    /// bytes read; the attention runs [`Backend::attention_fast_kv16`] (over the f16 values;
    /// on CUDA with f16 products, about bf16 SDPA's precision). Verify and decode share the
    /// cache and the kernels, whose rows never depend on the row count, so speculative
    /// decoding still commits exactly what plain greedy decode of the same target does.
    pub kv_storage: KvStorage,
}

/// The attention a target runs over its caches stored as `storage` (see
/// [`LoadOptions::kv_storage`]).
pub(crate) fn attn_op(storage: KvStorage) -> AttnOp {
    match storage {
        KvStorage::F32 => AttnOp::Exact,
        KvStorage::F16 => AttnOp::FastKv16,
    }
}

/// The K / V cache width `kvw` (values per position) in `storage`: [`KvStorage::F16`] packs
/// two values per slot and needs an even width.
pub(crate) fn check_kv_width(storage: KvStorage, kvw: usize) -> Result<()> {
    if storage == KvStorage::F16 && !kvw.is_multiple_of(2) {
        return Err(TargetError::Unsupported(format!(
            "an f16 K / V cache needs an even n_kv_heads * head_dim, found {kvw}"
        )));
    }
    Ok(())
}

struct Layer<B: Backend> {
    in_norm: B::Buf,
    post_norm: B::Buf,
    q_norm: B::Buf,
    k_norm: B::Buf,
    wq: Weight<B>,
    wk: Weight<B>,
    wv: Weight<B>,
    wo: Weight<B>,
    wg: Weight<B>,
    wu: Weight<B>,
    wd: Weight<B>,
}

/// Activation buffers of one forward width (reused across forwards of that width).
struct Scratch<B: Backend> {
    x: B::Buf,
    h: B::Buf,
    q: B::Buf,
    qn: B::Buf,
    k: B::Buf,
    kn: B::Buf,
    v: B::Buf,
    att: B::Buf,
    o: B::Buf,
    g: B::Buf,
    u: B::Buf,
    a: B::Buf,
    /// `[t, vocab]`; handed out (and re-allocated next time) when the caller keeps logits.
    logits: Option<B::Buf>,
}

/// Forward widths up to this many rows keep their scratch buffers (verify blocks, decode).
const SCRATCH_MAX_ROWS: usize = 64;

/// Which rows of a forward get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// None (argmax is empty).
    None,
    /// Only the last row (prime).
    Last,
    /// Every row.
    All,
}

/// The weights of a Qwen3 dense model (shared between instances, see [`Qwen3Dense::share`]).
struct Weights<B: Backend> {
    cfg: Qwen3Config,
    embed: Weight<B>,
    lm_head: Option<Weight<B>>,
    norm: B::Buf,
    layers: Vec<Layer<B>>,
}

/// A Qwen3 dense model with its KV cache. The weights sit behind an `Arc`: [`Self::share`]
/// makes another instance (its own cache, e.g. one per serving session) over the same weights.
pub struct Qwen3Dense<B: Backend> {
    w: Arc<Weights<B>>,
    k_cache: Vec<B::Buf>,
    v_cache: Vec<B::Buf>,
    kv: KvStorage,
    cap: usize,
    pos: usize,
    /// Rows of the last verify not yet committed (`start`, `rows`).
    pending: Option<(usize, usize)>,
    /// Scratch per forward width `t` (index `t`), up to [`SCRATCH_MAX_ROWS`].
    scratch: Vec<Option<Scratch<B>>>,
}

fn upload_vec<B: Backend>(be: &B, ck: &Checkpoint, name: &str, len: usize) -> Result<B::Buf> {
    Ok(be.upload(&ck.f32s(name, &[len])?)?)
}

impl<B: Backend> Qwen3Dense<B> {
    /// Load a `Qwen3ForCausalLM` checkpoint directory (tensor prefix `model.`).
    pub fn load(be: &B, dir: impl AsRef<std::path::Path>, opts: LoadOptions) -> Result<Self> {
        let ck = Checkpoint::open(dir)?;
        let cfg = Qwen3Config::from_cfg(&Cfg::new(ck.config_path(), ck.config()))?;
        Self::from_checkpoint(be, &ck, cfg, "model.", "lm_head.weight", opts)
    }

    /// Build from an open checkpoint with explicit tensor prefixes.
    pub fn from_checkpoint(
        be: &B,
        ck: &Checkpoint,
        cfg: Qwen3Config,
        prefix: &str,
        lm_head_name: &str,
        opts: LoadOptions,
    ) -> Result<Self> {
        let p = opts.precision;
        let d = cfg.hidden;
        let hd = cfg.head_dim;
        let w = |name: String, rows: usize, cols: usize| -> Result<Weight<B>> {
            Ok(be.upload_weight(&ck.weight(&name, rows, cols, p)?)?)
        };
        let embed = w(format!("{prefix}embed_tokens.weight"), cfg.vocab, d)?;
        let lm_head = if cfg.tie_embeddings && !ck.has(lm_head_name) {
            None
        } else {
            Some(w(lm_head_name.to_string(), cfg.vocab, d)?)
        };
        let norm = upload_vec(be, ck, &format!("{prefix}norm.weight"), d)?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let l = format!("{prefix}layers.{i}.");
            layers.push(Layer {
                in_norm: upload_vec(be, ck, &format!("{l}input_layernorm.weight"), d)?,
                post_norm: upload_vec(be, ck, &format!("{l}post_attention_layernorm.weight"), d)?,
                q_norm: upload_vec(be, ck, &format!("{l}self_attn.q_norm.weight"), hd)?,
                k_norm: upload_vec(be, ck, &format!("{l}self_attn.k_norm.weight"), hd)?,
                wq: w(format!("{l}self_attn.q_proj.weight"), cfg.n_heads * hd, d)?,
                wk: w(
                    format!("{l}self_attn.k_proj.weight"),
                    cfg.n_kv_heads * hd,
                    d,
                )?,
                wv: w(
                    format!("{l}self_attn.v_proj.weight"),
                    cfg.n_kv_heads * hd,
                    d,
                )?,
                wo: w(format!("{l}self_attn.o_proj.weight"), d, cfg.n_heads * hd)?,
                wg: w(format!("{l}mlp.gate_proj.weight"), cfg.intermediate, d)?,
                wu: w(format!("{l}mlp.up_proj.weight"), cfg.intermediate, d)?,
                wd: w(format!("{l}mlp.down_proj.weight"), d, cfg.intermediate)?,
            });
        }
        for name in unused_tensors(ck, &cfg, prefix, lm_head_name) {
            tracing::warn!(tensor = %name, "checkpoint tensor not used by the Qwen3 dense target");
        }
        let cap = opts.ctx_cap.unwrap_or(cfg.max_positions.min(4096));
        Self::assemble(be, cfg, embed, lm_head, norm, layers, cap, opts.kv_storage)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        be: &B,
        cfg: Qwen3Config,
        embed: Weight<B>,
        lm_head: Option<Weight<B>>,
        norm: B::Buf,
        layers: Vec<Layer<B>>,
        cap: usize,
        kv: KvStorage,
    ) -> Result<Self> {
        cfg.validate()?;
        Self::with_cache(
            be,
            Arc::new(Weights {
                cfg,
                embed,
                lm_head,
                norm,
                layers,
            }),
            cap,
            kv,
        )
    }

    fn with_cache(be: &B, w: Arc<Weights<B>>, cap: usize, kv: KvStorage) -> Result<Self> {
        let kvw = w.cfg.n_kv_heads * w.cfg.head_dim;
        check_kv_width(kv, kvw)?;
        let mut k_cache = Vec::with_capacity(w.cfg.n_layers);
        let mut v_cache = Vec::with_capacity(w.cfg.n_layers);
        for _ in 0..w.cfg.n_layers {
            k_cache.push(be.zeros(kv.slots(cap * kvw))?);
            v_cache.push(be.zeros(kv.slots(cap * kvw))?);
        }
        Ok(Qwen3Dense {
            w,
            k_cache,
            v_cache,
            kv,
            cap,
            pos: 0,
            pending: None,
            scratch: Vec::new(),
        })
    }

    /// Another instance over the same weights with its own empty cache of `cap` positions
    /// (stored as this one's).
    pub fn share(&self, be: &B, cap: usize) -> Result<Self> {
        Self::with_cache(be, Arc::clone(&self.w), cap, self.kv)
    }

    /// How the K / V caches store their values ([`LoadOptions::kv_storage`]).
    pub fn kv_storage(&self) -> KvStorage {
        self.kv
    }

    /// Store the K / V caches as `kv` says from now on: new empty caches of the same
    /// capacity (every cached position is dropped) unless they are stored so already.
    pub fn set_kv_storage(&mut self, be: &B, kv: KvStorage) -> Result<()> {
        if kv != self.kv {
            *self = Self::with_cache(be, Arc::clone(&self.w), self.cap, kv)?;
        }
        Ok(())
    }

    /// A model from host weights given by name (tests and random models): the same tensor
    /// names as the checkpoint without prefix (`embed_tokens.weight`, `layers.0....`,
    /// `norm.weight`, `lm_head.weight` unless tied). Vectors are f32.
    pub fn from_host(
        be: &B,
        cfg: Qwen3Config,
        get: &mut dyn FnMut(&str, &[usize]) -> Result<HostTensor>,
        cap: usize,
    ) -> Result<Self> {
        let d = cfg.hidden;
        let hd = cfg.head_dim;
        let mut mat = |name: String, rows: usize, cols: usize| -> Result<Weight<B>> {
            match get(&name, &[rows, cols])? {
                HostTensor::Matrix(hw) => Ok(be.upload_weight(&hw)?),
                HostTensor::Vector(_) => Err(TargetError::Shape {
                    name,
                    expected: vec![rows, cols],
                    found: vec![],
                }),
            }
        };
        let embed = mat("embed_tokens.weight".into(), cfg.vocab, d)?;
        let lm_head = if cfg.tie_embeddings {
            None
        } else {
            Some(mat("lm_head.weight".into(), cfg.vocab, d)?)
        };
        let mut layers_w = Vec::new();
        for i in 0..cfg.n_layers {
            let l = format!("layers.{i}.");
            layers_w.push((
                mat(format!("{l}self_attn.q_proj.weight"), cfg.n_heads * hd, d)?,
                mat(
                    format!("{l}self_attn.k_proj.weight"),
                    cfg.n_kv_heads * hd,
                    d,
                )?,
                mat(
                    format!("{l}self_attn.v_proj.weight"),
                    cfg.n_kv_heads * hd,
                    d,
                )?,
                mat(format!("{l}self_attn.o_proj.weight"), d, cfg.n_heads * hd)?,
                mat(format!("{l}mlp.gate_proj.weight"), cfg.intermediate, d)?,
                mat(format!("{l}mlp.up_proj.weight"), cfg.intermediate, d)?,
                mat(format!("{l}mlp.down_proj.weight"), d, cfg.intermediate)?,
            ));
        }
        let mut vec = |name: String, len: usize| -> Result<B::Buf> {
            match get(&name, &[len])? {
                HostTensor::Vector(v) if v.len() == len => Ok(be.upload(&v)?),
                _ => Err(TargetError::Shape {
                    name,
                    expected: vec![len],
                    found: vec![],
                }),
            }
        };
        let norm = vec("norm.weight".into(), d)?;
        let mut layers = Vec::new();
        for (i, (wq, wk, wv, wo, wg, wu, wd)) in layers_w.into_iter().enumerate() {
            let l = format!("layers.{i}.");
            layers.push(Layer {
                in_norm: vec(format!("{l}input_layernorm.weight"), d)?,
                post_norm: vec(format!("{l}post_attention_layernorm.weight"), d)?,
                q_norm: vec(format!("{l}self_attn.q_norm.weight"), hd)?,
                k_norm: vec(format!("{l}self_attn.k_norm.weight"), hd)?,
                wq,
                wk,
                wv,
                wo,
                wg,
                wu,
                wd,
            });
        }
        Self::assemble(be, cfg, embed, lm_head, norm, layers, cap, KvStorage::F32)
    }

    /// The model's shape.
    pub fn config(&self) -> &Qwen3Config {
        &self.w.cfg
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

    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Truncate the committed positions to `pos` (no-op if already shorter); drops any
    /// pending verify. Benches use it to repeat a verify at one position.
    pub fn prime_reset_to(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
        self.pending = None;
    }

    /// Drop every cached position.
    pub fn reset(&mut self) {
        self.pos = 0;
        self.pending = None;
    }

    /// Run `tokens` at positions `start..start + t` (writing their K/V into the cache),
    /// with taps after the given layers (`-1` = embedding output, `l` = residual stream after
    /// layer `l`, up to `n_layers - 1`), and logits for the requested rows.
    /// Does not change the committed length; `start` may be at most the committed length
    /// (rows after `start` are overwritten).
    pub fn forward(
        &mut self,
        be: &B,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        rows: LogitRows,
    ) -> Result<Forward<B>> {
        self.forward_inner(be, tokens, start, taps, rows, true)
    }

    fn new_scratch(&self, be: &B, t: usize) -> Result<Scratch<B>> {
        let c = &self.w.cfg;
        let (d, qw, kvw, i) = (
            c.hidden,
            c.n_heads * c.head_dim,
            c.n_kv_heads * c.head_dim,
            c.intermediate,
        );
        // Each op writes its output whole before any read (a cached scratch holds the last
        // call's values): no zero fill.
        Ok(Scratch {
            x: be.scratch(t * d)?,
            h: be.scratch(t * d)?,
            q: be.scratch(t * qw)?,
            qn: be.scratch(t * qw)?,
            k: be.scratch(t * kvw)?,
            kn: be.scratch(t * kvw)?,
            v: be.scratch(t * kvw)?,
            att: be.scratch(t * qw)?,
            o: be.scratch(t * d)?,
            g: be.scratch(t * i)?,
            u: be.scratch(t * i)?,
            a: be.scratch(t * i)?,
            logits: None,
        })
    }

    fn forward_inner(
        &mut self,
        be: &B,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        rows: LogitRows,
        return_logits: bool,
    ) -> Result<Forward<B>> {
        let t = tokens.len();
        let cached = (1..=SCRATCH_MAX_ROWS).contains(&t);
        let mut sc = match self.scratch.get_mut(t).and_then(Option::take) {
            Some(sc) if cached => sc,
            _ => self.new_scratch(be, t.max(1))?,
        };
        let r = self.forward_with(be, tokens, start, taps, rows, return_logits, &mut sc);
        if cached {
            if self.scratch.len() <= t {
                self.scratch.resize_with(t + 1, || None);
            }
            self.scratch[t] = Some(sc);
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_with(
        &mut self,
        be: &B,
        tokens: &[u32],
        start: usize,
        taps: &[i32],
        rows: LogitRows,
        return_logits: bool,
        sc: &mut Scratch<B>,
    ) -> Result<Forward<B>> {
        let c = &self.w.cfg;
        let t = tokens.len();
        let (d, hd) = (c.hidden, c.head_dim);
        check_forward_input(tokens, start, self.cap, c.vocab, taps, c.n_layers)?;
        let nt = taps.len();
        // Every tap layer is in -1..n_layers (checked above) and every layer runs: the taps
        // are written whole.
        let mut tap_buf = if nt > 0 {
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

        let Scratch {
            x,
            h,
            q,
            qn,
            k,
            kn,
            v,
            att,
            o,
            g,
            u,
            a,
            logits: sc_logits,
        } = sc;
        be.gather_rows(&self.w.embed, tokens, x)?;
        write_taps(be, -1, x, &mut tap_buf)?;

        for (li, layer) in self.w.layers.iter().enumerate() {
            // The backend's fused sequences (the bits of the separate ops).
            be.norm_matmul_many(
                &*x,
                &layer.in_norm,
                d,
                c.rms_eps,
                h,
                t,
                &[&layer.wq, &layer.wk, &layer.wv],
                &mut [&mut *q, &mut *k, &mut *v],
            )?;
            // Per-head norms + RoPE, K and V into the caches at `start` (one launch where the
            // backend fuses it; `kn` is its scratch).
            let qk = QkNormRope {
                q_norm: &layer.q_norm,
                k_norm: &layer.k_norm,
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: hd,
                eps: c.rms_eps,
                pos0: start,
                rope: &c.rope,
            };
            let cache = KvCacheRows {
                k: &mut self.k_cache[li],
                v: &mut self.v_cache[li],
                row0: start,
                storage: self.kv,
            };
            be.qk_norm_rope_kv(&*q, &*k, &*v, t, t, &qk, qn, kn, cache)?;
            let p = AttnParams {
                n_q: t,
                n_kv: start + t,
                n_heads: c.n_heads,
                n_kv_heads: c.n_kv_heads,
                head_dim: hd,
                q_pos0: start,
                kv_pos0: 0,
                causal: true,
                window: c.windows[li],
                scale: (hd as f32).powf(-0.5),
            };
            let tail = LayerTail {
                wo: &layer.wo,
                post_norm: &layer.post_norm,
                eps: c.rms_eps,
                w_gate: &layer.wg,
                w_up: &layer.wu,
                w_down: &layer.wd,
            };
            let scratch = TailScratch {
                o: &mut *o,
                xn: &mut *h,
                gate: &mut *g,
                up: &mut *u,
                act: &mut *a,
            };
            // The attention, then o, the residual add + norm and the MLP (a backend may hand
            // the attention's output to the o projection directly: the same bits).
            let (kc, vc, op) = (&self.k_cache[li], &self.v_cache[li], attn_op(self.kv));
            be.attention_layer_tail(&*qn, kc, vc, &p, op, att, x, &tail, scratch)?;
            write_taps(be, li as i32, &*x, &mut tap_buf)?;
        }
        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        let (argmax, logits) = match rows {
            LogitRows::None => (Vec::new(), None),
            LogitRows::Last => {
                let mut last = be.zeros(d)?;
                be.copy(x, (t - 1) * d, &mut last, 0, d)?;
                let mut ln = be.zeros(d)?;
                be.rms_norm(&last, &self.w.norm, d, c.rms_eps, &mut ln)?;
                let mut lg = be.zeros(c.vocab)?;
                be.matmul(&ln, 1, head, &mut lg)?;
                let am = be.argmax_rows(&lg, 0, 1, c.vocab)?;
                (am, return_logits.then_some(lg))
            }
            LogitRows::All => {
                be.rms_norm(x, &self.w.norm, d, c.rms_eps, h)?;
                let mut lg = match sc_logits.take() {
                    Some(lg) => lg,
                    None => be.zeros(t * c.vocab)?,
                };
                be.matmul(h, t, head, &mut lg)?;
                let am = be.argmax_rows(&lg, 0, t, c.vocab)?;
                if return_logits {
                    (am, Some(lg))
                } else {
                    *sc_logits = Some(lg);
                    (am, None)
                }
            }
        };
        Ok(Forward {
            argmax,
            logits,
            taps: tap_buf,
        })
    }
}

/// Census: tensors of `ck` that a Qwen3 dense target with `cfg` does not read (loading warns
/// about each through `tracing`).
pub fn unused_tensors(
    ck: &Checkpoint,
    cfg: &Qwen3Config,
    prefix: &str,
    lm_head_name: &str,
) -> Vec<String> {
    let mut used = std::collections::HashSet::new();
    used.insert(format!("{prefix}embed_tokens.weight"));
    used.insert(format!("{prefix}norm.weight"));
    used.insert(lm_head_name.to_string());
    for i in 0..cfg.n_layers {
        for t in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            used.insert(format!("{prefix}layers.{i}.{t}.weight"));
        }
    }
    ck.names()
        .filter(|n| !used.contains(*n))
        .map(str::to_string)
        .collect()
}

/// A host tensor handed to [`Qwen3Dense::from_host`].
pub enum HostTensor {
    Matrix(dflash_backend::HostWeight),
    Vector(Vec<f32>),
}

impl<B: Backend> Target<B> for Qwen3Dense<B> {
    fn info(&self) -> TargetInfo {
        TargetInfo {
            n_layers: self.w.cfg.n_layers,
            hidden: self.w.cfg.hidden,
            vocab: self.w.cfg.vocab,
            ctx_cap: self.cap,
        }
    }

    fn pos(&self) -> usize {
        self.pos
    }

    fn set_rollback(&mut self, _arm: RollbackArm) {}

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
        self.reset();
        let f = self.forward(be, prompt, 0, taps, LogitRows::Last)?;
        self.pos = prompt.len();
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
        let f = self.forward_inner(be, tokens, start, taps, LogitRows::All, want_logits)?;
        self.pending = Some((start, tokens.len()));
        Ok(f)
    }

    fn commit(&mut self, _be: &B, keep: usize) -> dflash_spec_round::Result<()> {
        match self.pending.take() {
            Some((start, rows)) if keep >= 1 && keep <= rows => {
                // Truncation: the K/V of rows past `keep` stay in the buffer but beyond the
                // committed length, and the next forward overwrites them.
                self.pos = start + keep;
                Ok(())
            }
            Some((_, rows)) => Err(SpecError::Protocol(format!(
                "commit of {keep} rows after a verify of {rows}"
            ))),
            None => Err(SpecError::Protocol("commit without a verify".into())),
        }
    }

    fn embed_rows(&self, be: &B, ids: &[u32], out: &mut B::Buf) -> dflash_backend::Result<()> {
        be.gather_rows(&self.w.embed, ids, out)
    }

    fn lm_head(&self) -> &Weight<B> {
        self.head()
    }
}

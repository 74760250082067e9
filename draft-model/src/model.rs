//! The drafter's weights and their loading: precision policy, census gate, shape checks.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use dflash_backend::{Backend, HostData, HostWeight, KvStorage, RopeSpec, Weight, WeightFormat};

use crate::checkpoint::{SafetensorsCheckpoint, TensorData, TensorMap, TensorSource};
use crate::config::{DraftConfig, RowLayout};
use crate::error::{DraftError, Result};

/// Storage precision of the drafter's 2-D linear weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Everything f32 (the reference).
    #[default]
    F32,
    /// Everything bf16 (lossless for bf16 checkpoints).
    Bf16,
    /// fc, q/k/v/o and gate/up/down in q8_0.
    Q8_0,
    /// fc, q/k/v/o and gate/up/down in q4_0.
    Q4_0,
    /// bf16 attention and fc (the context-conditioning path), q8_0 MLP.
    Mixed,
    /// fc, q/k/v/o and gate/up/down in [`WeightFormat::Q8_0A8`]: q8_0 weights times
    /// activations quantized to q8_0 (integer dots, ggml's CPU q8_0 arithmetic). The fastest
    /// on CPUs with an integer dot instruction; the drafts may differ from f32's, never the
    /// committed tokens (the target verifies them).
    Q8_0A8,
    /// The same matrices in [`WeightFormat::Q4_0A8`]: q4_0 weights times activations
    /// quantized to q8_0 (ggml's CPU q4_0 arithmetic), half the bytes of `Q8_0A8`.
    Q4_0A8,
}

/// The role of a linear weight, for the precision policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightRole {
    /// `fc.weight`.
    Fc,
    /// q/k/v/o projections.
    Attention,
    /// gate/up/down projections.
    Mlp,
}

impl Precision {
    /// Storage format of a linear weight of the given role.
    pub fn format_for(self, role: WeightRole) -> WeightFormat {
        match (self, role) {
            (Precision::F32, _) => WeightFormat::F32,
            (Precision::Bf16, _) => WeightFormat::Bf16,
            (Precision::Q8_0, _) => WeightFormat::Q8_0,
            (Precision::Q4_0, _) => WeightFormat::Q4_0,
            (Precision::Q8_0A8, _) => WeightFormat::Q8_0A8,
            (Precision::Q4_0A8, _) => WeightFormat::Q4_0A8,
            (Precision::Mixed, WeightRole::Mlp) => WeightFormat::Q8_0,
            (Precision::Mixed, _) => WeightFormat::Bf16,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = DraftError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            "q8_0" | "q8" => Precision::Q8_0,
            "q4_0" | "q4" => Precision::Q4_0,
            "mixed" => Precision::Mixed,
            "q8_0a8" | "q8a8" => Precision::Q8_0A8,
            "q4_0a8" | "q4a8" => Precision::Q4_0A8,
            other => {
                return Err(DraftError::Unsupported {
                    what: "precision".into(),
                    value: other.into(),
                })
            }
        })
    }
}

/// How to load a drafter.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOptions {
    pub precision: Precision,
    /// Force a row layout instead of the one the checkpoint's architecture implies.
    pub layout_override: Option<RowLayout>,
    /// Scan every tensor for NaN / infinity and report the first one as an error.
    pub validate: bool,
    /// Run the drafter's attention through [`Backend::attention_fast`] (reduced-precision
    /// products where the backend has them: TF32 tensor cores on CUDA; the CPU computes the
    /// exact op either way). The drafts may differ from the exact op's, never the committed
    /// tokens (the target verifies them).
    pub fast_attention: bool,
    /// How [`Drafter::new_kv`] stores the draft KV cache: [`KvStorage::F16`] (needs
    /// `fast_attention`) halves its memory and the bytes each step's attention reads
    /// ([`Backend::attention_fast_kv16`]); K and V rounded to f16 once, when written, where the
    /// f32 cache's fast kernels round them on every read (CUDA, spans over 2048 keys) or cut
    /// them to tf32.
    pub kv_storage: KvStorage,
}

/// One draft decoder layer.
pub struct DraftLayer<B: Backend> {
    pub wq: Weight<B>,
    pub wk: Weight<B>,
    pub wv: Weight<B>,
    pub wo: Weight<B>,
    pub w_gate: Weight<B>,
    pub w_up: Weight<B>,
    pub w_down: Weight<B>,
    /// `[hidden]`
    pub ln_in: B::Buf,
    /// `[hidden]`
    pub ln_post: B::Buf,
    /// `[head_dim]`
    pub q_norm: B::Buf,
    /// `[head_dim]`
    pub k_norm: B::Buf,
}

/// The vanilla DSpark Markov head: `bias(prev) = W2 · W1[prev]`.
pub struct MarkovHead<B: Backend> {
    /// `[vocab, rank]` (row-gathered by the previous token).
    pub w1: Weight<B>,
    /// `[vocab, rank]` (`nn.Linear(rank, vocab)`).
    pub w2: Weight<B>,
    pub rank: usize,
}

/// The DSpark confidence (accept-rate) head: logit = `w · [z ; W1[prev]] + b`.
pub struct ConfidenceHead<B: Backend> {
    /// `[1, in_dim]`, f32.
    pub w: Weight<B>,
    pub bias: f32,
    /// Input includes the Markov embedding of the previous token.
    pub with_markov: bool,
}

/// A loaded DFlash / DSpark drafter, resident on backend `B`.
pub struct Drafter<B: Backend> {
    pub cfg: DraftConfig,
    /// The effective row layout (config or override).
    pub layout: RowLayout,
    pub precision: Precision,
    /// `[hidden, n_taps * hidden]`
    pub fc: Weight<B>,
    /// `[hidden]`
    pub hidden_norm: B::Buf,
    /// `[hidden]`
    pub norm: B::Buf,
    pub layers: Vec<DraftLayer<B>>,
    pub markov: Option<MarkovHead<B>>,
    pub confidence: Option<ConfidenceHead<B>>,
    /// A learned mask embedding (`[hidden]`) used for block rows 1.. instead of the target's
    /// embedding of the mask token, when the checkpoint ships one.
    pub mask_embedding: Option<B::Buf>,
    /// RoPE of each layer.
    pub ropes: Vec<RopeSpec>,
    /// The attention through [`Backend::attention_fast`] ([`LoadOptions::fast_attention`]).
    pub fast_attention: bool,
    /// How the draft KV cache stores K and V ([`LoadOptions::kv_storage`]).
    pub kv_storage: KvStorage,
    /// Activation buffers of the last cached block forward, reused by the next one of the
    /// same block length (no allocation per step; stable buffers for the GPU).
    pub(crate) scratch: std::sync::Mutex<Option<crate::forward::Scratch<B>>>,
    /// [`Drafter::ingest`]'s buffers per row count of a round (index = rows, up to a block),
    /// reused while free.
    pub(crate) ingest_scratch: std::sync::Mutex<Vec<Option<crate::forward::IngestScratch<B>>>>,
}

impl<B: Backend> std::fmt::Debug for Drafter<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drafter")
            .field("layers", &self.layers.len())
            .field("hidden", &self.cfg.hidden_size)
            .field("block_size", &self.cfg.block_size)
            .field("layout", &self.layout)
            .field("precision", &self.precision)
            .field("markov", &self.markov.as_ref().map(|m| m.rank))
            .field("confidence", &self.confidence.is_some())
            .finish()
    }
}

/// Tensors that published checkpoints carry but a drafter does not need (the DeepSpec copies
/// of the target's embedding and head).
const KNOWN_EXTRAS: &[&str] = &["embed_tokens.weight", "lm_head.weight"];
const MASK_EMBEDDING: &[&str] = &["mask_embedding", "mask_embedding.weight"];

/// Canonical name of a stored tensor: `model.` prefixes dropped, the early SpecForge
/// `logit_head.` nesting of the DSpark heads remapped.
pub fn canonical_name(stored: &str) -> String {
    let mut n = stored.strip_prefix("model.").unwrap_or(stored);
    if let Some(rest) = n.strip_prefix("logit_head.") {
        n = rest;
        if n.starts_with("markov_w") {
            return format!("markov_head.{n}");
        }
    }
    n.to_string()
}

struct Loader<'a> {
    src: &'a dyn TensorSource,
    /// canonical -> stored
    names: BTreeMap<String, String>,
    consumed: BTreeSet<String>,
    validate: bool,
}

impl<'a> Loader<'a> {
    fn new(src: &'a dyn TensorSource, validate: bool) -> Result<Self> {
        let mut names = BTreeMap::new();
        for stored in src.names() {
            let canon = canonical_name(&stored);
            if let Some(prev) = names.insert(canon.clone(), stored.clone()) {
                return Err(DraftError::Invalid(format!(
                    "tensors `{prev}` and `{stored}` both map to `{canon}`"
                )));
            }
        }
        Ok(Loader {
            src,
            names,
            consumed: BTreeSet::new(),
            validate,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.src.shape(self.names.get(name)?)
    }

    /// Read a tensor, check its shape, optionally its finiteness, and mark it consumed.
    fn take(&mut self, name: &str, expected: &[usize]) -> Result<TensorData> {
        let stored = self
            .names
            .get(name)
            .ok_or_else(|| DraftError::MissingTensor(name.into()))?
            .clone();
        let found = self
            .src
            .shape(&stored)
            .ok_or_else(|| DraftError::MissingTensor(name.into()))?;
        if found != expected {
            return Err(DraftError::Shape {
                tensor: name.into(),
                expected: expected.to_vec(),
                found,
            });
        }
        let data = self.src.read(&stored)?;
        if self.validate {
            let vals = data.to_f32();
            if let Some((index, &value)) = vals.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(DraftError::NonFinite {
                    tensor: name.into(),
                    index,
                    value,
                });
            }
        }
        self.consumed.insert(name.to_string());
        Ok(data)
    }

    fn vector<B: Backend>(&mut self, be: &B, name: &str, len: usize) -> Result<B::Buf> {
        let v = self.take(name, &[len])?.to_f32();
        Ok(be.upload(&v)?)
    }

    fn matrix<B: Backend>(
        &mut self,
        be: &B,
        name: &str,
        rows: usize,
        cols: usize,
        format: WeightFormat,
    ) -> Result<Weight<B>> {
        self.matrix_with(be, name, rows, cols, |_| format)
    }

    /// Like [`Loader::matrix`], the format chosen from the stored data.
    fn matrix_with<B: Backend>(
        &mut self,
        be: &B,
        name: &str,
        rows: usize,
        cols: usize,
        pick: impl Fn(&TensorData) -> WeightFormat,
    ) -> Result<Weight<B>> {
        let data = self.take(name, &[rows, cols])?;
        let format = pick(&data);
        let hw = host_weight(name, rows, cols, data, format)?;
        Ok(be.upload_weight(&hw)?)
    }
}

/// Encode stored values into `format`. bf16 / f16 values going to their own format keep their
/// bits (lossless, and NaN-safe); everything else goes through f32 and `HostWeight::from_f32`.
fn host_weight(
    name: &str,
    rows: usize,
    cols: usize,
    data: TensorData,
    format: WeightFormat,
) -> Result<HostWeight> {
    let enc_err = |e: dflash_backend::BackendError| DraftError::Encode {
        tensor: name.into(),
        format: format!("{format:?}"),
        msg: e.to_string(),
    };
    match (data, format) {
        (TensorData::Bf16(bits), WeightFormat::Bf16) => {
            HostWeight::new(name, rows, cols, HostData::Bf16(bits)).map_err(enc_err)
        }
        (TensorData::F16(bits), WeightFormat::F16) => {
            HostWeight::new(name, rows, cols, HostData::F16(bits)).map_err(enc_err)
        }
        (TensorData::F32(v), WeightFormat::F32) => {
            HostWeight::new(name, rows, cols, HostData::F32(v)).map_err(enc_err)
        }
        (d, fmt) => HostWeight::from_f32(name, rows, cols, &d.to_f32(), fmt).map_err(enc_err),
    }
}

impl<B: Backend> Drafter<B> {
    /// Every resident weight matrix (linear layers and heads; not the 1-D norms).
    pub fn weights(&self) -> Vec<&Weight<B>> {
        let mut w = vec![&self.fc];
        for l in &self.layers {
            w.extend([&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
        }
        if let Some(m) = &self.markov {
            w.extend([&m.w1, &m.w2]);
        }
        if let Some(c) = &self.confidence {
            w.push(&c.w);
        }
        w
    }

    /// Parameters of the weight matrices plus the norms (the borrowed embedding / lm_head
    /// excluded).
    pub fn n_params(&self) -> usize {
        let c = &self.cfg;
        let norms = 2 * c.hidden_size + self.layers.len() * (2 * c.hidden_size + 2 * c.head_dim);
        self.weights()
            .iter()
            .map(|w| w.rows * w.cols)
            .sum::<usize>()
            + norms
    }

    /// Bytes of the weight matrices in their storage formats (norms as f32).
    pub fn weight_bytes(&self) -> usize {
        let c = &self.cfg;
        let norms = 2 * c.hidden_size + self.layers.len() * (2 * c.hidden_size + 2 * c.head_dim);
        self.weights()
            .iter()
            .map(|w| w.format.bytes_for(w.rows * w.cols))
            .sum::<usize>()
            + 4 * norms
    }
}

impl<B: Backend> Drafter<B> {
    /// Load `dir/config.json` and the checkpoint in `dir` (single file or sharded).
    pub fn load(be: &B, dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let cfg = DraftConfig::from_file(dir)?;
        let ck = SafetensorsCheckpoint::open(dir)?;
        Self::from_source(be, cfg, &ck, opts)
    }

    /// Build from an in-memory tensor map (name -> (shape, f32 values)), with the same
    /// checks, policy and census as a file.
    pub fn from_tensors(
        be: &B,
        cfg: DraftConfig,
        tensors: &TensorMap,
        opts: &LoadOptions,
    ) -> Result<Self> {
        Self::from_source(be, cfg, tensors, opts)
    }

    /// Build from any tensor source.
    pub fn from_source(
        be: &B,
        cfg: DraftConfig,
        src: &dyn TensorSource,
        opts: &LoadOptions,
    ) -> Result<Self> {
        if opts.kv_storage == KvStorage::F16 && !opts.fast_attention {
            return Err(DraftError::Invalid(
                "an f16 draft KV cache (kv_storage F16) needs fast_attention: the exact attention reads f32".into(),
            ));
        }
        if opts.kv_storage == KvStorage::F16 && !cfg.kv_dim().is_multiple_of(2) {
            return Err(DraftError::Invalid(format!(
                "an f16 draft KV cache needs an even kv width, the config has {}",
                cfg.kv_dim()
            )));
        }
        let mut ld = Loader::new(src, opts.validate)?;
        let d = cfg.hidden_size;
        let (qd, kvd, hd, inter) = (
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.head_dim,
            cfg.intermediate_size,
        );
        let p = opts.precision;
        let f_attn = p.format_for(WeightRole::Attention);
        let f_mlp = p.format_for(WeightRole::Mlp);

        let fc = ld.matrix(
            be,
            "fc.weight",
            d,
            cfg.n_taps() * d,
            p.format_for(WeightRole::Fc),
        )?;
        let hidden_norm = ld.vector(be, "hidden_norm.weight", d)?;
        let norm = ld.vector(be, "norm.weight", d)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let n = |s: &str| format!("layers.{i}.{s}");
            layers.push(DraftLayer {
                wq: ld.matrix(be, &n("self_attn.q_proj.weight"), qd, d, f_attn)?,
                wk: ld.matrix(be, &n("self_attn.k_proj.weight"), kvd, d, f_attn)?,
                wv: ld.matrix(be, &n("self_attn.v_proj.weight"), kvd, d, f_attn)?,
                wo: ld.matrix(be, &n("self_attn.o_proj.weight"), d, qd, f_attn)?,
                w_gate: ld.matrix(be, &n("mlp.gate_proj.weight"), inter, d, f_mlp)?,
                w_up: ld.matrix(be, &n("mlp.up_proj.weight"), inter, d, f_mlp)?,
                w_down: ld.matrix(be, &n("mlp.down_proj.weight"), d, inter, f_mlp)?,
                ln_in: ld.vector(be, &n("input_layernorm.weight"), d)?,
                ln_post: ld.vector(be, &n("post_attention_layernorm.weight"), d)?,
                q_norm: ld.vector(be, &n("self_attn.q_norm.weight"), hd)?,
                k_norm: ld.vector(be, &n("self_attn.k_norm.weight"), hd)?,
            });
        }

        // ---- DSpark heads (presence from the tensors; the config, when it declares them,
        // must agree).
        let v = cfg.vocab_size;
        let w1n = "markov_head.markov_w1.weight";
        let w2n = "markov_head.markov_w2.weight";
        let declared_rank = cfg.dspark.as_ref().map(|d| d.markov_rank).unwrap_or(0);
        let markov = if ld.has(w1n) || declared_rank > 0 {
            let rank = if declared_rank > 0 {
                declared_rank
            } else {
                match ld.shape(w1n) {
                    Some(s) if s.len() == 2 => s[1],
                    found => {
                        return Err(DraftError::Shape {
                            tensor: w1n.into(),
                            expected: vec![v, 0],
                            found: found.unwrap_or_default(),
                        })
                    }
                }
            };
            // Lossless storage: bf16 sources stay bf16 unless the policy is all-f32, so the
            // values are the f32 upcast in every policy.
            let pick = |d: &TensorData| match (p, d) {
                (Precision::F32, _) => WeightFormat::F32,
                (_, TensorData::Bf16(_)) => WeightFormat::Bf16,
                _ => WeightFormat::F32,
            };
            Some(MarkovHead {
                w1: ld.matrix_with(be, w1n, v, rank, pick)?,
                w2: ld.matrix_with(be, w2n, v, rank, pick)?,
                rank,
            })
        } else {
            None
        };

        let cwn = "confidence_head.proj.weight";
        let cbn = "confidence_head.proj.bias";
        let declared_conf = cfg
            .dspark
            .as_ref()
            .is_some_and(|d| d.enable_confidence_head);
        let confidence = if ld.has(cwn) || declared_conf {
            let rank = markov.as_ref().map_or(0, |m| m.rank);
            // The config, when it declares the head, fixes its input; otherwise the tensor's
            // shape says whether the Markov embedding is part of it.
            let declared_in = cfg
                .dspark
                .as_ref()
                .filter(|ds| ds.enable_confidence_head)
                .map(|ds| {
                    d + if ds.confidence_head_with_markov {
                        rank
                    } else {
                        0
                    }
                });
            let in_dim = match (declared_in, ld.shape(cwn)) {
                (_, None) => return Err(DraftError::MissingTensor(cwn.into())),
                (Some(i), Some(_)) => i,
                (None, Some(s)) if rank > 0 && s == [1, d + rank] => d + rank,
                (None, Some(_)) => d,
            };
            let w = ld.take(cwn, &[1, in_dim])?.to_f32();
            let b = ld.take(cbn, &[1])?.to_f32();
            let hw = HostWeight::new(cwn, 1, in_dim, HostData::F32(w))?;
            Some(ConfidenceHead {
                w: be.upload_weight(&hw)?,
                bias: b[0],
                with_markov: in_dim != d,
            })
        } else {
            None
        };

        let mut mask_embedding = None;
        for name in MASK_EMBEDDING {
            if let Some(shape) = ld.shape(name) {
                let n: usize = shape.iter().product();
                if n != d || shape.iter().any(|&s| s != 1 && s != d) {
                    return Err(DraftError::Shape {
                        tensor: (*name).into(),
                        expected: vec![d],
                        found: shape,
                    });
                }
                let vals = ld.take(name, &shape)?.to_f32();
                mask_embedding = Some(be.upload(&vals)?);
            }
        }

        // ---- census gate
        for name in KNOWN_EXTRAS {
            if ld.has(name) {
                ld.consumed.insert((*name).to_string());
            }
        }
        let leftovers: Vec<String> = ld
            .names
            .iter()
            .filter(|(canon, _)| !ld.consumed.contains(*canon))
            .map(|(_, stored)| stored.clone())
            .collect();
        if !leftovers.is_empty() {
            if markov.is_some() {
                return Err(DraftError::UnknownTensors(leftovers));
            }
            tracing::warn!(
                ?leftovers,
                "DFlash checkpoint has tensors the drafter ignores"
            );
        }

        let ropes = (0..cfg.num_hidden_layers)
            .map(|i| cfg.rope_for(i).spec())
            .collect();
        let layout = opts.layout_override.unwrap_or(cfg.layout);
        tracing::debug!(
            layers = cfg.num_hidden_layers,
            ?layout,
            precision = ?p,
            markov = markov.is_some(),
            confidence = confidence.is_some(),
            "drafter loaded"
        );
        Ok(Drafter {
            cfg,
            layout,
            precision: p,
            fc,
            hidden_norm,
            norm,
            layers,
            markov,
            confidence,
            mask_embedding,
            ropes,
            fast_attention: opts.fast_attention,
            kv_storage: opts.kv_storage,
            scratch: std::sync::Mutex::new(None),
            ingest_scratch: std::sync::Mutex::new(Vec::new()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0a8_precision_maps_every_matrix_and_parses() {
        for role in [WeightRole::Fc, WeightRole::Attention, WeightRole::Mlp] {
            assert_eq!(
                Precision::Q8_0A8.format_for(role),
                WeightFormat::Q8_0A8,
                "{role:?}"
            );
        }
        for s in ["q8_0a8", "Q8A8", "q8a8"] {
            assert_eq!(s.parse::<Precision>().unwrap(), Precision::Q8_0A8, "{s}");
        }
        assert!("q8_0_a8".parse::<Precision>().is_err());
        for role in [WeightRole::Fc, WeightRole::Attention, WeightRole::Mlp] {
            assert_eq!(Precision::Q4_0A8.format_for(role), WeightFormat::Q4_0A8);
        }
        for s in ["q4_0a8", "Q4A8"] {
            assert_eq!(s.parse::<Precision>().unwrap(), Precision::Q4_0A8, "{s}");
        }
    }
}

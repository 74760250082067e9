//! Weights of the hybrid model: where they come from (a checkpoint or host tensors), how the
//! fused / interleaved tensors of the published layouts are split at load time, and the
//! zero-centred RMSNorm fold.

use std::collections::{BTreeMap, BTreeSet};

use dflash_backend::{Backend, HostData, HostWeight, Weight, WeightFormat};
use dflash_quant::QK;

use super::config::{HybridArch, HybridConfig, LayerKind};
use crate::checkpoint::Checkpoint;
use crate::{Result, TargetError};

/// Where the loader reads tensors: an HF checkpoint, or named host tensors (tests, random
/// models).
pub trait TensorSource {
    /// Whether `name` exists.
    fn has(&self, name: &str) -> bool;
    /// A 2-D tensor `[rows, cols]` in its stored format, or re-encoded into `precision`.
    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        precision: Option<WeightFormat>,
    ) -> Result<HostWeight>;
    /// Values of a tensor of `shape`, as f32.
    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;
    /// Every tensor name.
    fn names(&self) -> Vec<String>;
}

impl TensorSource for Checkpoint {
    fn has(&self, name: &str) -> bool {
        Checkpoint::has(self, name)
    }

    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        precision: Option<WeightFormat>,
    ) -> Result<HostWeight> {
        self.weight(name, rows, cols, precision)
    }

    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.f32s(name, shape)
    }

    fn names(&self) -> Vec<String> {
        Checkpoint::names(self).map(str::to_string).collect()
    }
}

/// Named f32 host tensors (row-major), for tests and random models.
#[derive(Clone, Debug, Default)]
pub struct HostTensors {
    map: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl HostTensors {
    pub fn new() -> Self {
        Self::default()
    }

    /// Insert a tensor; errors if the values do not fill the shape.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        values: Vec<f32>,
    ) -> Result<()> {
        let name = name.into();
        let n: usize = shape.iter().product();
        if n != values.len() {
            return Err(TargetError::Shape {
                name,
                expected: shape.to_vec(),
                found: vec![values.len()],
            });
        }
        self.map.insert(name, (shape.to_vec(), values));
        Ok(())
    }

    /// The stored shape of `name`.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.map.get(name).map(|(s, _)| s.as_slice())
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<&[f32]> {
        let (s, v) = self
            .map
            .get(name)
            .ok_or_else(|| TargetError::MissingTensor { name: name.into() })?;
        if s != shape {
            return Err(TargetError::Shape {
                name: name.into(),
                expected: shape.to_vec(),
                found: s.clone(),
            });
        }
        Ok(v)
    }
}

impl TensorSource for HostTensors {
    fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        precision: Option<WeightFormat>,
    ) -> Result<HostWeight> {
        let v = self.get(name, &[rows, cols])?;
        Ok(HostWeight::from_f32(
            name,
            rows,
            cols,
            v,
            precision.unwrap_or(WeightFormat::F32),
        )?)
    }

    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self.get(name, shape)?.to_vec())
    }

    fn names(&self) -> Vec<String> {
        self.map.keys().cloned().collect()
    }
}

/// The rows `ranges` (`(first_row, n_rows)`, in order) of `hw`, as a new weight named `name`.
/// Works on every storage format (block formats quantize rows independently).
pub(crate) fn take_rows(
    hw: &HostWeight,
    name: &str,
    ranges: &[(usize, usize)],
) -> Result<HostWeight> {
    fn pick<T: Copy>(v: &[T], per_row: usize, ranges: &[(usize, usize)]) -> Vec<T> {
        let mut out = Vec::with_capacity(ranges.iter().map(|r| r.1).sum::<usize>() * per_row);
        for &(r0, n) in ranges {
            out.extend_from_slice(&v[r0 * per_row..(r0 + n) * per_row]);
        }
        out
    }
    for &(r0, n) in ranges {
        if r0 + n > hw.rows {
            return Err(TargetError::Shape {
                name: hw.name.clone(),
                expected: vec![r0 + n, hw.cols],
                found: vec![hw.rows, hw.cols],
            });
        }
    }
    let rows = ranges.iter().map(|r| r.1).sum();
    let c = hw.cols;
    let data = match &hw.data {
        HostData::F32(v) => HostData::F32(pick(v, c, ranges)),
        HostData::Bf16(v) => HostData::Bf16(pick(v, c, ranges)),
        HostData::F16(v) => HostData::F16(pick(v, c, ranges)),
        HostData::Q8_0(b) => HostData::Q8_0(pick(b, c / QK, ranges)),
        HostData::Q4_0(b) => HostData::Q4_0(pick(b, c / QK, ranges)),
        HostData::Q8_0A8(b) => HostData::Q8_0A8(pick(b, c / QK, ranges)),
        HostData::Q4_0A8(b) => HostData::Q4_0A8(pick(b, c / QK, ranges)),
    };
    Ok(HostWeight::new(name, rows, c, data)?)
}

/// One Gated DeltaNet mixer.
pub(crate) struct LinearWeights<B: Backend> {
    /// `[2·nk·dk + nv·dv, d]`: q, k (key-head order) then v (value-head order).
    pub qkv: Weight<B>,
    /// `[nv·dv, d]`.
    pub z: Weight<B>,
    /// `[nv, d]`.
    pub b: Weight<B>,
    /// `[nv, d]`.
    pub a: Weight<B>,
    /// Depthwise conv taps `[channels, kernel]`.
    pub conv: B::Buf,
    pub a_log: B::Buf,
    pub dt_bias: B::Buf,
    /// Gated RMSNorm weight `[dv]` (plain, not zero-centred).
    pub norm: B::Buf,
    /// `[d, nv·dv]`.
    pub out: Weight<B>,
}

/// One gated full-attention mixer.
pub(crate) struct FullWeights<B: Backend> {
    /// Query rows of `q_proj` (`[n_heads·hd, d]`).
    pub q: Weight<B>,
    /// Output-gate rows of `q_proj` (`[n_heads·hd, d]`).
    pub gate: Weight<B>,
    pub k: Weight<B>,
    pub v: Weight<B>,
    pub o: Weight<B>,
    /// `1 + w` of the zero-centred q_norm / k_norm.
    pub q_norm: B::Buf,
    pub k_norm: B::Buf,
}

pub(crate) enum Mixer<B: Backend> {
    Linear(LinearWeights<B>),
    Full(FullWeights<B>),
}

/// A SwiGLU MLP `down(silu(gate(x)) ⊙ up(x))`.
pub(crate) struct SwiGlu<B: Backend> {
    pub gate: Weight<B>,
    pub up: Weight<B>,
    pub down: Weight<B>,
}

/// The sparse MoE block.
pub(crate) struct MoeWeights<B: Backend> {
    /// Router `[n_experts, d]`.
    pub router: Weight<B>,
    pub experts: Vec<SwiGlu<B>>,
    pub shared: SwiGlu<B>,
    /// `[1, d]`.
    pub shared_gate: Weight<B>,
}

pub(crate) enum Mlp<B: Backend> {
    Dense(SwiGlu<B>),
    Moe(MoeWeights<B>),
}

pub(crate) struct LayerWeights<B: Backend> {
    /// `1 + w` of the zero-centred input / post-attention norms.
    pub in_norm: B::Buf,
    pub post_norm: B::Buf,
    pub mixer: Mixer<B>,
    pub mlp: Mlp<B>,
}

pub(crate) struct ModelWeights<B: Backend> {
    pub embed: Weight<B>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Weight<B>>,
    /// `1 + w` of the final zero-centred norm.
    pub norm: B::Buf,
    pub layers: Vec<LayerWeights<B>>,
}

/// Tensor-name layout of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorNames {
    /// Prefix of the text model (`model.`, `model.language_model.`, ...), ending in a dot.
    pub prefix: String,
    /// Name of the output projection.
    pub lm_head: String,
}

impl TensorNames {
    /// Find the text model in `src`: the text-only causal LM (`model.`), the vision-language
    /// layout of transformers 5 and of the published Qwen3.5 checkpoints
    /// (`model.language_model.`), or the older wrapper layout (`language_model.model.`).
    pub fn detect(src: &dyn TensorSource) -> Result<Self> {
        const LAYOUTS: [(&str, &str); 3] = [
            ("model.language_model.", "lm_head.weight"),
            ("model.", "lm_head.weight"),
            ("language_model.model.", "language_model.lm_head.weight"),
        ];
        for (prefix, head) in LAYOUTS {
            if src.has(&format!("{prefix}embed_tokens.weight")) {
                return Ok(TensorNames {
                    prefix: prefix.into(),
                    lm_head: head.into(),
                });
            }
        }
        Err(TargetError::MissingTensor {
            name: "embed_tokens.weight (looked under `model.language_model.`, `model.`, `language_model.model.`)"
                .into(),
        })
    }
}

struct Loader<'a, B: Backend> {
    be: &'a B,
    src: &'a dyn TensorSource,
    precision: Option<WeightFormat>,
    used: BTreeSet<String>,
}

impl<B: Backend> Loader<'_, B> {
    fn host(&mut self, name: &str, rows: usize, cols: usize) -> Result<HostWeight> {
        self.used.insert(name.to_string());
        self.src.matrix(name, rows, cols, self.precision)
    }

    fn mat(&mut self, name: &str, rows: usize, cols: usize) -> Result<Weight<B>> {
        let hw = self.host(name, rows, cols)?;
        Ok(self.be.upload_weight(&hw)?)
    }

    fn vals(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.used.insert(name.to_string());
        self.src.values(name, shape)
    }

    fn vec(&mut self, name: &str, len: usize) -> Result<B::Buf> {
        let v = self.vals(name, &[len])?;
        Ok(self.be.upload(&v)?)
    }

    /// A zero-centred RMSNorm weight with transformers' `1 + w` folded in (exact in f32:
    /// transformers computes the same `1.0 + w` in f32).
    fn norm(&mut self, name: &str, len: usize) -> Result<B::Buf> {
        let v: Vec<f32> = self.vals(name, &[len])?.iter().map(|&w| 1.0 + w).collect();
        Ok(self.be.upload(&v)?)
    }
}

/// Load every weight of `cfg` from `src` under `names`.
pub(crate) fn load_weights<B: Backend>(
    be: &B,
    src: &dyn TensorSource,
    cfg: &HybridConfig,
    names: &TensorNames,
    precision: Option<WeightFormat>,
) -> Result<ModelWeights<B>> {
    let mut ld = Loader {
        be,
        src,
        precision,
        used: BTreeSet::new(),
    };
    let p = &names.prefix;
    let d = cfg.hidden;
    let embed = ld.mat(&format!("{p}embed_tokens.weight"), cfg.vocab, d)?;
    let lm_head = if src.has(&names.lm_head) {
        Some(ld.mat(&names.lm_head, cfg.vocab, d)?)
    } else if cfg.tie_embeddings {
        None
    } else {
        return Err(TargetError::MissingTensor {
            name: names.lm_head.clone(),
        });
    };
    let norm = ld.norm(&format!("{p}norm.weight"), d)?;
    let (nk, nv, dk, dv) = (cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_dk, cfg.lin_dv);
    let r = nv / nk;
    let (hd, nh) = (cfg.head_dim, cfg.n_heads);
    let kvw = cfg.n_kv_heads * hd;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for (i, kind) in cfg.layer_kinds.iter().enumerate() {
        let l = format!("{p}layers.{i}.");
        let mixer = match kind {
            LayerKind::Linear => {
                let a = format!("{l}linear_attn.");
                let ch = cfg.conv_channels();
                let (qkv, z, b, a_w) = if cfg.arch == HybridArch::Qwen3Next
                    || src.has(&format!("{a}in_proj_qkvz.weight"))
                {
                    // Fused, interleaved per key head g: [q_g (dk), k_g (dk), v_g (r·dv), z_g (r·dv)]
                    // and [b_g (r), a_g (r)] (transformers `fix_query_key_value_ordering`).
                    let gw = 2 * dk + 2 * r * dv;
                    let qkvz_name = format!("{a}in_proj_qkvz.weight");
                    let qkvz = ld.host(&qkvz_name, nk * gw, d)?;
                    let part = |off: usize, n: usize| -> Vec<(usize, usize)> {
                        (0..nk).map(|g| (g * gw + off, n)).collect()
                    };
                    let mut ranges = part(0, dk);
                    ranges.extend(part(dk, dk));
                    ranges.extend(part(2 * dk, r * dv));
                    let qkv = take_rows(&qkvz, &format!("{qkvz_name}[qkv]"), &ranges)?;
                    let z = take_rows(
                        &qkvz,
                        &format!("{qkvz_name}[z]"),
                        &part(2 * dk + r * dv, r * dv),
                    )?;
                    let ba_name = format!("{a}in_proj_ba.weight");
                    let ba = ld.host(&ba_name, 2 * nv, d)?;
                    let b = take_rows(
                        &ba,
                        &format!("{ba_name}[b]"),
                        &(0..nk).map(|g| (g * 2 * r, r)).collect::<Vec<_>>(),
                    )?;
                    let a_w = take_rows(
                        &ba,
                        &format!("{ba_name}[a]"),
                        &(0..nk).map(|g| (g * 2 * r + r, r)).collect::<Vec<_>>(),
                    )?;
                    (qkv, z, b, a_w)
                } else {
                    (
                        ld.host(&format!("{a}in_proj_qkv.weight"), ch, d)?,
                        ld.host(&format!("{a}in_proj_z.weight"), nv * dv, d)?,
                        ld.host(&format!("{a}in_proj_b.weight"), nv, d)?,
                        ld.host(&format!("{a}in_proj_a.weight"), nv, d)?,
                    )
                };
                let conv = ld.vals(&format!("{a}conv1d.weight"), &[ch, 1, cfg.conv_kernel])?;
                Mixer::Linear(LinearWeights {
                    qkv: be.upload_weight(&qkv)?,
                    z: be.upload_weight(&z)?,
                    b: be.upload_weight(&b)?,
                    a: be.upload_weight(&a_w)?,
                    conv: be.upload(&conv)?,
                    a_log: ld.vec(&format!("{a}A_log"), nv)?,
                    dt_bias: ld.vec(&format!("{a}dt_bias"), nv)?,
                    norm: ld.vec(&format!("{a}norm.weight"), dv)?,
                    out: ld.mat(&format!("{a}out_proj.weight"), d, nv * dv)?,
                })
            }
            LayerKind::Full => {
                let s = format!("{l}self_attn.");
                // q_proj rows per head h: [query_h (hd), gate_h (hd)] (transformers
                // `view(..., -1, 2·hd).chunk(2)`).
                let qname = format!("{s}q_proj.weight");
                let qg = ld.host(&qname, 2 * nh * hd, d)?;
                let q = take_rows(
                    &qg,
                    &format!("{qname}[query]"),
                    &(0..nh).map(|h| (2 * h * hd, hd)).collect::<Vec<_>>(),
                )?;
                let gate = take_rows(
                    &qg,
                    &format!("{qname}[gate]"),
                    &(0..nh).map(|h| (2 * h * hd + hd, hd)).collect::<Vec<_>>(),
                )?;
                Mixer::Full(FullWeights {
                    q: be.upload_weight(&q)?,
                    gate: be.upload_weight(&gate)?,
                    k: ld.mat(&format!("{s}k_proj.weight"), kvw, d)?,
                    v: ld.mat(&format!("{s}v_proj.weight"), kvw, d)?,
                    o: ld.mat(&format!("{s}o_proj.weight"), d, nh * hd)?,
                    q_norm: ld.norm(&format!("{s}q_norm.weight"), hd)?,
                    k_norm: ld.norm(&format!("{s}k_norm.weight"), hd)?,
                })
            }
        };
        let m = format!("{l}mlp.");
        let mlp = match (cfg.moe_layers[i], cfg.moe) {
            (false, _) => Mlp::Dense(SwiGlu {
                gate: ld.mat(&format!("{m}gate_proj.weight"), cfg.intermediate, d)?,
                up: ld.mat(&format!("{m}up_proj.weight"), cfg.intermediate, d)?,
                down: ld.mat(&format!("{m}down_proj.weight"), d, cfg.intermediate)?,
            }),
            (true, None) => {
                return Err(TargetError::Unsupported(format!(
                    "layer {i} is MoE but the config has no MoE shape"
                )))
            }
            (true, Some(moe)) => {
                let mi = moe.intermediate;
                let si = moe.shared_intermediate;
                let fused = format!("{m}experts.gate_up_proj");
                let experts = if src.has(&fused) {
                    // transformers' in-memory layout: gate_up_proj [E, 2I, d] (gate rows
                    // first), down_proj [E, d, I].
                    let gu = ld.vals(&fused, &[moe.n_experts, 2 * mi, d])?;
                    let dn = ld.vals(&format!("{m}experts.down_proj"), &[moe.n_experts, d, mi])?;
                    let mut ex = Vec::with_capacity(moe.n_experts);
                    for e in 0..moe.n_experts {
                        let g0 = e * 2 * mi * d;
                        let w =
                            |name: String, r: usize, c: usize, v: &[f32]| -> Result<Weight<B>> {
                                let hw = HostWeight::from_f32(
                                    name,
                                    r,
                                    c,
                                    v,
                                    precision.unwrap_or(WeightFormat::F32),
                                )?;
                                Ok(be.upload_weight(&hw)?)
                            };
                        ex.push(SwiGlu {
                            gate: w(format!("{fused}[{e}].gate"), mi, d, &gu[g0..g0 + mi * d])?,
                            up: w(
                                format!("{fused}[{e}].up"),
                                mi,
                                d,
                                &gu[g0 + mi * d..g0 + 2 * mi * d],
                            )?,
                            down: w(
                                format!("{m}experts.down_proj[{e}]"),
                                d,
                                mi,
                                &dn[e * d * mi..(e + 1) * d * mi],
                            )?,
                        });
                    }
                    ex
                } else {
                    (0..moe.n_experts)
                        .map(|e| {
                            let x = format!("{m}experts.{e}.");
                            Ok(SwiGlu {
                                gate: ld.mat(&format!("{x}gate_proj.weight"), mi, d)?,
                                up: ld.mat(&format!("{x}up_proj.weight"), mi, d)?,
                                down: ld.mat(&format!("{x}down_proj.weight"), d, mi)?,
                            })
                        })
                        .collect::<Result<Vec<_>>>()?
                };
                let x = format!("{m}shared_expert.");
                Mlp::Moe(MoeWeights {
                    router: ld.mat(&format!("{m}gate.weight"), moe.n_experts, d)?,
                    experts,
                    shared: SwiGlu {
                        gate: ld.mat(&format!("{x}gate_proj.weight"), si, d)?,
                        up: ld.mat(&format!("{x}up_proj.weight"), si, d)?,
                        down: ld.mat(&format!("{x}down_proj.weight"), d, si)?,
                    },
                    shared_gate: ld.mat(&format!("{m}shared_expert_gate.weight"), 1, d)?,
                })
            }
        };
        layers.push(LayerWeights {
            in_norm: ld.norm(&format!("{l}input_layernorm.weight"), d)?,
            post_norm: ld.norm(&format!("{l}post_attention_layernorm.weight"), d)?,
            mixer,
            mlp,
        });
    }
    // Census: the vision tower and the multi-token-prediction head are not part of the text
    // target; anything else left over is reported.
    let (mut vision, mut mtp, mut other) = (0usize, 0usize, Vec::new());
    for n in src.names() {
        if ld.used.contains(&n) {
            continue;
        }
        if n.contains("visual.") || n.contains("vision_tower.") {
            vision += 1;
        } else if n.starts_with("mtp.") || n.contains(".mtp.") {
            mtp += 1;
        } else {
            other.push(n);
        }
    }
    if vision > 0 {
        tracing::info!(
            vision,
            "hybrid target: ignoring the vision tower tensors (text part only)"
        );
    }
    if mtp > 0 {
        tracing::info!(
            mtp,
            "hybrid target: ignoring the multi-token-prediction head tensors"
        );
    }
    if !other.is_empty() {
        tracing::warn!(count = other.len(), first = %other[0], "hybrid target: unused tensors in the checkpoint");
    }
    Ok(ModelWeights {
        embed,
        lm_head,
        norm,
        layers,
    })
}

//! Drafter configuration (`config.json`), parsed with serde from the published schemas:
//!
//! * z-lab DFlash: `dflash_config.{mask_token_id, target_layer_ids}` nested, `block_size` top
//!   level (or nested);
//! * DeepSpec `Qwen3DSparkModel` and the seed: the same keys at top level, DSpark keys
//!   (`markov_rank`, `markov_head_type`, `enable_confidence_head`,
//!   `confidence_head_with_markov`) at top level;
//! * SpecForge `DSparkDraftModel`: DSpark keys nested in `dflash_config`;
//! * RoPE from `rope_theta` / `rope_scaling` (transformers 4) or `rope_parameters`
//!   (transformers 5, possibly per layer type).
//!
//! Attention kinds: a layer slides iff `layer_types[i] == "sliding_attention"` (window
//! `sliding_window`, or `dflash_config.swa_window_size`); `dflash_config.use_swa = true` makes
//! every layer slide (vLLM). `use_sliding_window` only matters when `layer_types` is absent
//! (transformers' Qwen3Config rule with `max_window_layers`); an explicit `layer_types` wins,
//! as in vLLM and the seed.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{DraftError, Result};
use crate::rope::{RopeConfig, RopeScaling};

/// Which block rows become drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowLayout {
    /// z-lab DFlash (and SpecForge `DSparkDraftModel`): rows `1..b` draft positions
    /// `s+1..s+b-1` (row `r` drafts position `s + r`); `b - 1` drafts.
    DFlash,
    /// DeepSpec `Qwen3DSparkModel`: rows `0..b` draft positions `s+1..s+b` (row `r` drafts
    /// position `s + r + 1`); `b` drafts.
    AnchorPredicts,
}

impl RowLayout {
    /// First block row that becomes a draft.
    pub fn first_row(self) -> usize {
        match self {
            RowLayout::DFlash => 1,
            RowLayout::AnchorPredicts => 0,
        }
    }

    /// Number of drafts a block of `block_len` rows yields.
    pub fn n_drafts(self, block_len: usize) -> usize {
        block_len.saturating_sub(self.first_row())
    }
}

/// The kind of attention of one draft layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// No mask: every block row sees every context row and every block row.
    Full,
    /// Causal window over absolute positions: query at `p` sees keys at `q` with
    /// `p - window < q <= p` (context and block rows alike).
    Sliding { window: usize },
}

/// DSpark heads declared by the config.
#[derive(Clone, Debug, PartialEq)]
pub struct DsparkConfig {
    /// `markov_rank` (0 = no Markov head).
    pub markov_rank: usize,
    /// `markov_head_type` (only "vanilla" is implemented).
    pub markov_head_type: String,
    pub enable_confidence_head: bool,
    pub confidence_head_with_markov: bool,
}

/// The typed drafter configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftConfig {
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Tapped target layers (HF `hidden_states[l + 1]`; -1 = embedding output), in order.
    pub target_layer_ids: Vec<i64>,
    /// `num_target_layers` when the config gives it.
    pub num_target_layers: Option<usize>,
    /// Per draft layer.
    pub layer_kinds: Vec<LayerKind>,
    /// RoPE of full-attention layers (and of every layer unless per-layer-type parameters exist).
    pub rope: RopeConfig,
    /// RoPE of sliding layers when `rope_parameters` is keyed by layer type.
    pub rope_sliding: Option<RopeConfig>,
    pub dspark: Option<DsparkConfig>,
    /// Row layout chosen from the checkpoint's architecture (the load options may override it).
    pub layout: RowLayout,
}

// ------------------------------------------------------------------ raw serde view

#[derive(Debug, Default, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    type_: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
    attention_factor: Option<f64>,
    truncate: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct RawNested {
    mask_token_id: Option<u32>,
    target_layer_ids: Option<Vec<i64>>,
    block_size: Option<usize>,
    markov_rank: Option<usize>,
    markov_head_type: Option<String>,
    enable_confidence_head: Option<bool>,
    confidence_head_with_markov: Option<bool>,
    use_swa: Option<bool>,
    swa_window_size: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    rms_norm_eps: Option<f64>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    block_size: Option<usize>,
    mask_token_id: Option<u32>,
    target_layer_ids: Option<Vec<i64>>,
    num_target_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    max_position_embeddings: Option<f64>,
    /// Phi3-style top-level pretraining length (transformers gives it precedence).
    original_max_position_embeddings: Option<f64>,
    dflash_config: Option<RawNested>,
    markov_rank: Option<usize>,
    markov_head_type: Option<String>,
    enable_confidence_head: Option<bool>,
    confidence_head_with_markov: Option<bool>,
}

/// The default tap rule of z-lab's `build_target_layer_ids` (semantics §2.2): one draft layer
/// taps the middle layer; otherwise `round(1 + i·(n_target − 4)/(n_draft − 1))` with Python's
/// round-half-to-even.
pub fn default_target_layer_ids(n_target: usize, n_draft: usize) -> Vec<i64> {
    if n_draft == 0 {
        return Vec::new();
    }
    if n_draft == 1 {
        return vec![(n_target / 2) as i64];
    }
    let span = n_target as i64 - 4;
    (0..n_draft as i64)
        .map(|i| (1.0 + (i * span) as f64 / (n_draft as f64 - 1.0)).round_ties_even() as i64)
        .collect()
}

fn req<T>(v: Option<T>, key: &str) -> Result<T> {
    v.ok_or_else(|| DraftError::MissingKey(key.into()))
}

fn positive(v: usize, key: &str) -> Result<usize> {
    if v == 0 {
        Err(DraftError::InvalidConfig {
            key: key.into(),
            msg: "must be > 0".into(),
        })
    } else {
        Ok(v)
    }
}

fn rope_from_raw(
    raw: &RawRope,
    top_orig: Option<f64>,
    theta_fallback: Option<f64>,
    prf_fallback: Option<f64>,
    head_dim: usize,
    max_pos: Option<f64>,
    key: &str,
) -> Result<RopeConfig> {
    let theta = raw
        .rope_theta
        .or(theta_fallback)
        .ok_or_else(|| DraftError::MissingKey("rope_theta".into()))?;
    let prf = raw.partial_rotary_factor.or(prf_fallback).unwrap_or(1.0);
    if !(prf > 0.0 && prf <= 1.0) {
        return Err(DraftError::InvalidConfig {
            key: "partial_rotary_factor".into(),
            msg: format!("must be in (0, 1], found {prf}"),
        });
    }
    let rot_dim = (head_dim as f64 * prf) as usize;
    let ty = raw
        .rope_type
        .as_deref()
        .or(raw.type_.as_deref())
        .unwrap_or("default");
    let k = |s: &str| format!("{key}.{s}");
    let orig = || {
        top_orig
            .or(raw.original_max_position_embeddings)
            .or(max_pos)
            .ok_or_else(|| DraftError::MissingKey(k("original_max_position_embeddings")))
    };
    let scaling = match ty {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: req(raw.factor, &k("factor"))?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: req(raw.factor, &k("factor"))?,
            low_freq_factor: req(raw.low_freq_factor, &k("low_freq_factor"))?,
            high_freq_factor: req(raw.high_freq_factor, &k("high_freq_factor"))?,
            original_max_position_embeddings: orig()?,
        },
        "yarn" => {
            let original = orig()?;
            // transformers 5: factor None -> max_position_embeddings / original.
            let factor = match raw.factor {
                Some(f) => f,
                None => req(max_pos, "max_position_embeddings")? / original,
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: raw.beta_fast.filter(|&b| b != 0.0).unwrap_or(32.0),
                beta_slow: raw.beta_slow.filter(|&b| b != 0.0).unwrap_or(1.0),
                mscale: raw.mscale,
                mscale_all_dim: raw.mscale_all_dim,
                attention_factor: raw.attention_factor,
                truncate: raw.truncate.unwrap_or(true),
            }
        }
        other => {
            return Err(DraftError::Unsupported {
                what: format!("{key}.rope_type"),
                value: other.into(),
            })
        }
    };
    let rc = RopeConfig {
        theta,
        rot_dim,
        scaling,
    };
    rc.validate(head_dim)?;
    Ok(rc)
}

impl DraftConfig {
    /// Parse `config.json` text.
    pub fn from_json_str(text: &str) -> std::result::Result<Self, ConfigParseError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(ConfigParseError::Json)?;
        Self::from_raw(raw).map_err(ConfigParseError::Config)
    }

    /// Read and parse `dir/config.json` (or a file path).
    pub fn from_file(path: &Path) -> Result<Self> {
        let path = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&path).map_err(|source| DraftError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ConfigParseError::Json(source) => DraftError::Json { path, source },
            ConfigParseError::Config(e) => e,
        })
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        let nested = raw.dflash_config.unwrap_or_default();
        let hidden_size = positive(req(raw.hidden_size, "hidden_size")?, "hidden_size")?;
        let num_hidden_layers = positive(
            req(raw.num_hidden_layers, "num_hidden_layers")?,
            "num_hidden_layers",
        )?;
        let num_attention_heads = positive(
            req(raw.num_attention_heads, "num_attention_heads")?,
            "num_attention_heads",
        )?;
        let num_key_value_heads = positive(
            raw.num_key_value_heads.unwrap_or(num_attention_heads),
            "num_key_value_heads",
        )?;
        if !num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(DraftError::InvalidConfig {
                key: "num_key_value_heads".into(),
                msg: format!(
                    "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"
                ),
            });
        }
        let head_dim = match raw.head_dim {
            Some(h) => positive(h, "head_dim")?,
            None => {
                if !hidden_size.is_multiple_of(num_attention_heads) {
                    return Err(DraftError::MissingKey("head_dim".into()));
                }
                hidden_size / num_attention_heads
            }
        };
        let intermediate_size = positive(
            req(raw.intermediate_size, "intermediate_size")?,
            "intermediate_size",
        )?;
        let vocab_size = positive(req(raw.vocab_size, "vocab_size")?, "vocab_size")?;
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6) as f32;
        if let Some(act) = raw.hidden_act.as_deref() {
            if act != "silu" {
                return Err(DraftError::Unsupported {
                    what: "hidden_act".into(),
                    value: act.into(),
                });
            }
        }
        if raw.attention_bias == Some(true) {
            return Err(DraftError::Unsupported {
                what: "attention_bias".into(),
                value: "true".into(),
            });
        }
        let block_size = positive(
            req(raw.block_size.or(nested.block_size), "block_size")?,
            "block_size",
        )?;
        let mask_token_id = req(
            nested.mask_token_id.or(raw.mask_token_id),
            "dflash_config.mask_token_id",
        )?;
        if mask_token_id as usize >= vocab_size {
            return Err(DraftError::InvalidConfig {
                key: "mask_token_id".into(),
                msg: format!("{mask_token_id} >= vocab_size {vocab_size}"),
            });
        }
        let target_layer_ids = match nested.target_layer_ids.or(raw.target_layer_ids) {
            Some(ids) => ids,
            None => {
                let n_target = req(raw.num_target_layers, "num_target_layers")?;
                default_target_layer_ids(n_target, num_hidden_layers)
            }
        };
        if target_layer_ids.is_empty() {
            return Err(DraftError::InvalidConfig {
                key: "target_layer_ids".into(),
                msg: "empty".into(),
            });
        }
        for &id in &target_layer_ids {
            let over = raw.num_target_layers.is_some_and(|n| id >= n as i64 - 1);
            if id < -1 || over {
                return Err(DraftError::InvalidConfig {
                    key: "target_layer_ids".into(),
                    msg: format!(
                        "layer {id} is not a valid tap (allowed: -1..=num_target_layers-2, num_target_layers = {:?})",
                        raw.num_target_layers
                    ),
                });
            }
        }

        // ---- attention kinds
        let window = nested.swa_window_size.or(raw.sliding_window);
        let layer_types: Vec<String> = if nested.use_swa == Some(true) {
            vec!["sliding_attention".into(); num_hidden_layers]
        } else if let Some(lt) = raw.layer_types.clone() {
            lt
        } else {
            // transformers' Qwen3Config rule when layer_types is absent.
            let mwl = raw.max_window_layers.unwrap_or(28);
            (0..num_hidden_layers)
                .map(|i| {
                    if raw.use_sliding_window == Some(true) && window.is_some() && i >= mwl {
                        "sliding_attention".to_string()
                    } else {
                        "full_attention".to_string()
                    }
                })
                .collect()
        };
        if layer_types.len() != num_hidden_layers {
            return Err(DraftError::InvalidConfig {
                key: "layer_types".into(),
                msg: format!(
                    "{} entries for num_hidden_layers = {num_hidden_layers}",
                    layer_types.len()
                ),
            });
        }
        let mut layer_kinds = Vec::with_capacity(num_hidden_layers);
        for t in &layer_types {
            layer_kinds.push(match t.as_str() {
                "full_attention" => LayerKind::Full,
                "sliding_attention" => {
                    let w =
                        window.ok_or_else(|| DraftError::MissingKey("sliding_window".into()))?;
                    LayerKind::Sliding {
                        window: positive(w, "sliding_window")?,
                    }
                }
                other => {
                    return Err(DraftError::Unsupported {
                        what: "layer_types entry".into(),
                        value: other.into(),
                    })
                }
            });
        }

        // ---- rope
        let max_pos = raw.max_position_embeddings;
        let (rope, rope_sliding) = match &raw.rope_parameters {
            Some(Value::Object(map))
                if map.contains_key("full_attention") || map.contains_key("sliding_attention") =>
            {
                let parse = |key: &str| -> Result<Option<RopeConfig>> {
                    match map.get(key) {
                        None | Some(Value::Null) => Ok(None),
                        Some(v) => {
                            let r: RawRope = serde_json::from_value(v.clone()).map_err(|e| {
                                DraftError::InvalidConfig {
                                    key: format!("rope_parameters.{key}"),
                                    msg: e.to_string(),
                                }
                            })?;
                            rope_from_raw(
                                &r,
                                raw.original_max_position_embeddings,
                                raw.rope_theta,
                                raw.partial_rotary_factor,
                                head_dim,
                                max_pos,
                                &format!("rope_parameters.{key}"),
                            )
                            .map(Some)
                        }
                    }
                };
                let full = parse("full_attention")?;
                let sliding = parse("sliding_attention")?;
                match (full, sliding) {
                    (Some(f), s) => (f, s),
                    (None, Some(s)) => (s, None),
                    (None, None) => {
                        return Err(DraftError::MissingKey(
                            "rope_parameters.full_attention".into(),
                        ))
                    }
                }
            }
            Some(Value::Null) | None => {
                let r = raw.rope_scaling.unwrap_or_default();
                let rc = rope_from_raw(
                    &r,
                    raw.original_max_position_embeddings,
                    raw.rope_theta,
                    raw.partial_rotary_factor,
                    head_dim,
                    max_pos,
                    "rope_scaling",
                )?;
                (rc, None)
            }
            Some(v) => {
                let r: RawRope =
                    serde_json::from_value(v.clone()).map_err(|e| DraftError::InvalidConfig {
                        key: "rope_parameters".into(),
                        msg: e.to_string(),
                    })?;
                let rc = rope_from_raw(
                    &r,
                    raw.original_max_position_embeddings,
                    raw.rope_theta,
                    raw.partial_rotary_factor,
                    head_dim,
                    max_pos,
                    "rope_parameters",
                )?;
                (rc, None)
            }
        };

        // ---- DSpark heads
        let markov_rank = nested.markov_rank.or(raw.markov_rank).unwrap_or(0);
        let enable_conf = nested
            .enable_confidence_head
            .or(raw.enable_confidence_head)
            .unwrap_or(false);
        let dspark = if markov_rank > 0 || enable_conf {
            Some(DsparkConfig {
                markov_rank,
                markov_head_type: nested
                    .markov_head_type
                    .or(raw.markov_head_type)
                    .unwrap_or_else(|| "vanilla".into()),
                enable_confidence_head: enable_conf,
                confidence_head_with_markov: nested
                    .confidence_head_with_markov
                    .or(raw.confidence_head_with_markov)
                    .unwrap_or(markov_rank > 0),
            })
        } else {
            None
        };
        if let Some(d) = &dspark {
            if d.markov_rank > 0 && d.markov_head_type != "vanilla" {
                return Err(DraftError::Unsupported {
                    what: "markov_head_type".into(),
                    value: d.markov_head_type.clone(),
                });
            }
        }

        let architectures = raw.architectures.unwrap_or_default();
        let layout = if architectures.iter().any(|a| a == "Qwen3DSparkModel") {
            RowLayout::AnchorPredicts
        } else {
            RowLayout::DFlash
        };

        Ok(DraftConfig {
            architectures,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            rms_norm_eps,
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers: raw.num_target_layers,
            layer_kinds,
            rope,
            rope_sliding,
            dspark,
            layout,
        })
    }

    /// Every tensor a checkpoint of this config must hold (canonical names) with its shape:
    /// the DFlash backbone, plus the Markov head when `dspark.markov_rank > 0` and the
    /// confidence head when `dspark.enable_confidence_head`.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (d, hd, inter) = (self.hidden_size, self.head_dim, self.intermediate_size);
        let (qd, kvd) = (self.q_dim(), self.kv_dim());
        let mut t = vec![
            ("fc.weight".to_string(), vec![d, self.n_taps() * d]),
            ("hidden_norm.weight".to_string(), vec![d]),
            ("norm.weight".to_string(), vec![d]),
        ];
        for i in 0..self.num_hidden_layers {
            let n = |s: &str| format!("layers.{i}.{s}");
            t.push((n("input_layernorm.weight"), vec![d]));
            t.push((n("post_attention_layernorm.weight"), vec![d]));
            t.push((n("self_attn.q_proj.weight"), vec![qd, d]));
            t.push((n("self_attn.k_proj.weight"), vec![kvd, d]));
            t.push((n("self_attn.v_proj.weight"), vec![kvd, d]));
            t.push((n("self_attn.o_proj.weight"), vec![d, qd]));
            t.push((n("self_attn.q_norm.weight"), vec![hd]));
            t.push((n("self_attn.k_norm.weight"), vec![hd]));
            t.push((n("mlp.gate_proj.weight"), vec![inter, d]));
            t.push((n("mlp.up_proj.weight"), vec![inter, d]));
            t.push((n("mlp.down_proj.weight"), vec![d, inter]));
        }
        if let Some(ds) = &self.dspark {
            let r = ds.markov_rank;
            if r > 0 {
                t.push((
                    "markov_head.markov_w1.weight".into(),
                    vec![self.vocab_size, r],
                ));
                t.push((
                    "markov_head.markov_w2.weight".into(),
                    vec![self.vocab_size, r],
                ));
            }
            if ds.enable_confidence_head {
                let extra = if ds.confidence_head_with_markov { r } else { 0 };
                t.push(("confidence_head.proj.weight".into(), vec![1, d + extra]));
                t.push(("confidence_head.proj.bias".into(), vec![1]));
            }
        }
        t
    }

    /// Number of tapped target layers (`m`).
    pub fn n_taps(&self) -> usize {
        self.target_layer_ids.len()
    }

    /// Width of one K or V row: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Width of one Q row: `num_attention_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// The RoPE configuration of layer `i`.
    pub fn rope_for(&self, i: usize) -> &RopeConfig {
        match (self.layer_kinds.get(i), &self.rope_sliding) {
            (Some(LayerKind::Sliding { .. }), Some(r)) => r,
            _ => &self.rope,
        }
    }

    /// The largest sliding window, if any layer slides.
    pub fn max_window(&self) -> Option<usize> {
        self.layer_kinds
            .iter()
            .filter_map(|k| match k {
                LayerKind::Sliding { window } => Some(*window),
                LayerKind::Full => None,
            })
            .max()
    }
}

/// Error of [`DraftConfig::from_json_str`] (no file path to report).
#[derive(Debug, thiserror::Error)]
pub enum ConfigParseError {
    #[error("invalid JSON: {0}")]
    Json(#[source] serde_json::Error),
    #[error(transparent)]
    Config(DraftError),
}

#[cfg(test)]
mod tests {
    use super::*;

    const ZLAB: &str = r#"{
      "architectures": ["DFlashDraftModel"],
      "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
      "model_type": "qwen3",
      "block_size": 16,
      "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
      "num_target_layers": 36,
      "num_hidden_layers": 5,
      "hidden_size": 4096,
      "num_attention_heads": 32,
      "num_key_value_heads": 8,
      "head_dim": 128,
      "intermediate_size": 12288,
      "hidden_act": "silu",
      "rms_norm_eps": 1e-06,
      "attention_bias": false,
      "rope_theta": 1000000,
      "rope_scaling": null,
      "max_position_embeddings": 40960,
      "layer_types": ["full_attention","full_attention","full_attention","full_attention","full_attention"],
      "sliding_window": null,
      "use_sliding_window": false,
      "vocab_size": 151936,
      "tie_word_embeddings": false,
      "dtype": "bfloat16"
    }"#;

    #[test]
    fn zlab_schema() {
        let c = DraftConfig::from_json_str(ZLAB).unwrap();
        assert_eq!(c.block_size, 16);
        assert_eq!(c.mask_token_id, 151669);
        assert_eq!(c.target_layer_ids, vec![1, 9, 17, 25, 33]);
        assert_eq!(c.layer_kinds, vec![LayerKind::Full; 5]);
        assert_eq!(c.layout, RowLayout::DFlash);
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.rope.rot_dim, 128);
        assert_eq!(c.rope.scaling, RopeScaling::Default);
        assert!(c.dspark.is_none());
        assert_eq!(c.kv_dim(), 1024);
    }

    #[test]
    fn deepspec_schema_top_level() {
        let txt = r#"{
          "architectures": ["Qwen3DSparkModel"], "block_size": 7, "mask_token_id": 151669,
          "target_layer_ids": [1, 9, 17, 25, 33], "num_target_layers": 36,
          "enable_confidence_head": true, "confidence_head_with_markov": true,
          "markov_rank": 256, "markov_head_type": "vanilla",
          "num_hidden_layers": 5, "hidden_size": 2560, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936,
          "layer_types": ["full_attention","full_attention","full_attention","full_attention","full_attention"]
        }"#;
        let c = DraftConfig::from_json_str(txt).unwrap();
        assert_eq!(c.layout, RowLayout::AnchorPredicts);
        let d = c.dspark.unwrap();
        assert_eq!(d.markov_rank, 256);
        assert!(d.enable_confidence_head && d.confidence_head_with_markov);
        assert_eq!(c.block_size, 7);
    }

    #[test]
    fn specforge_nested_dspark_and_block_size() {
        let txt = r#"{
          "architectures": ["DSparkDraftModel"],
          "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2], "block_size": 4,
             "projector_type": "dspark", "markov_rank": 32, "markov_head_type": "vanilla",
             "enable_confidence_head": true, "confidence_head_with_markov": false},
          "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 100,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
        }"#;
        let c = DraftConfig::from_json_str(txt).unwrap();
        assert_eq!(c.layout, RowLayout::DFlash);
        assert_eq!(c.block_size, 4);
        assert_eq!(c.head_dim, 16, "head_dim absent -> hidden / heads");
        assert_eq!(c.num_key_value_heads, 4, "kv heads default to heads");
        let d = c.dspark.unwrap();
        assert_eq!(d.markov_rank, 32);
        assert!(!d.confidence_head_with_markov);
        assert_eq!(c.rope.theta, 10000.0);
    }

    #[test]
    fn default_layer_id_rule() {
        // semantics §2.2 examples
        assert_eq!(default_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(default_target_layer_ids(40, 5), vec![1, 10, 19, 28, 37]);
        assert_eq!(default_target_layer_ids(32, 5), vec![1, 8, 15, 22, 29]);
        assert_eq!(default_target_layer_ids(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(default_target_layer_ids(48, 5), vec![1, 12, 23, 34, 45]);
        assert_eq!(default_target_layer_ids(24, 5), vec![1, 6, 11, 16, 21]);
        assert_eq!(default_target_layer_ids(36, 1), vec![18]);
        // Banker's rounding on exact .5: n_target 9, n_draft 3 -> 1 + i*5/2 = 1, 3.5, 6
        // -> round(3.5) = 4 (even); n_target 11, 3 -> 1, 4.5, 8 -> 4 (even).
        assert_eq!(default_target_layer_ids(9, 3), vec![1, 4, 6]);
        assert_eq!(default_target_layer_ids(11, 3), vec![1, 4, 8]);
        // and the rule is used when the config has no ids
        let txt = ZLAB.replace(r#", "target_layer_ids": [1, 9, 17, 25, 33]"#, "");
        let c = DraftConfig::from_json_str(&txt).unwrap();
        assert_eq!(c.target_layer_ids, vec![1, 9, 17, 25, 33]);
    }

    #[test]
    fn sliding_layers_and_null_window() {
        let txt = ZLAB
            .replace(
                r#"["full_attention","full_attention","full_attention","full_attention","full_attention"]"#,
                r#"["sliding_attention","sliding_attention","sliding_attention","sliding_attention","full_attention"]"#,
            )
            .replace(r#""sliding_window": null"#, r#""sliding_window": 2048"#);
        let c = DraftConfig::from_json_str(&txt).unwrap();
        assert_eq!(c.layer_kinds[0], LayerKind::Sliding { window: 2048 });
        assert_eq!(c.layer_kinds[4], LayerKind::Full);
        assert_eq!(c.max_window(), Some(2048));
        // a sliding layer with a null window is an error naming the key
        let bad = ZLAB.replace(
            r#"["full_attention","full_attention","full_attention","full_attention","full_attention"]"#,
            r#"["sliding_attention","full_attention","full_attention","full_attention","full_attention"]"#,
        );
        match DraftConfig::from_json_str(&bad) {
            Err(ConfigParseError::Config(DraftError::MissingKey(k))) => {
                assert_eq!(k, "sliding_window")
            }
            other => panic!("{other:?}"),
        }
        // no layer_types: use_sliding_window + max_window_layers as transformers' Qwen3Config
        let txt = ZLAB
            .replace(
                r#""layer_types": ["full_attention","full_attention","full_attention","full_attention","full_attention"],"#,
                r#""max_window_layers": 3,"#,
            )
            .replace(r#""sliding_window": null"#, r#""sliding_window": 64"#)
            .replace(r#""use_sliding_window": false"#, r#""use_sliding_window": true"#);
        let c = DraftConfig::from_json_str(&txt).unwrap();
        assert_eq!(
            c.layer_kinds,
            vec![
                LayerKind::Full,
                LayerKind::Full,
                LayerKind::Full,
                LayerKind::Sliding { window: 64 },
                LayerKind::Sliding { window: 64 }
            ]
        );
    }

    #[test]
    fn rope_variants_from_config() {
        let yarn = ZLAB.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
        );
        let c = DraftConfig::from_json_str(&yarn).unwrap();
        let spec = c.rope.spec();
        assert!((spec.attention_scaling - 1.138_629_4).abs() < 1e-6);
        assert_eq!(spec.inv_freq.len(), 64);
        // transformers 5 rope_parameters with theta inside and no factor: max_pos / original
        let t5 = ZLAB.replace(
            r#""rope_theta": 1000000,"#,
            r#""rope_parameters": {"rope_type": "yarn", "rope_theta": 10000000.0, "original_max_position_embeddings": 4096},"#,
        ).replace(r#""max_position_embeddings": 40960"#, r#""max_position_embeddings": 262144"#);
        let c = DraftConfig::from_json_str(&t5).unwrap();
        match &c.rope.scaling {
            RopeScaling::Yarn { factor, .. } => assert_eq!(*factor, 64.0),
            s => panic!("{s:?}"),
        }
        assert!((c.rope.attention_factor() - 1.4158883083).abs() < 1e-9);
        // Phi3-style top-level original_max_position_embeddings takes precedence
        let top = ZLAB.replace(
            r#""rope_scaling": null"#,
            r#""original_max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
        );
        match DraftConfig::from_json_str(&top).unwrap().rope.scaling {
            RopeScaling::Yarn {
                original_max_position_embeddings,
                ..
            } => assert_eq!(original_max_position_embeddings, 4096.0),
            s => panic!("{s:?}"),
        }
        // old-style "type" key, linear
        let lin = ZLAB.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"type": "linear", "factor": 2.0}"#,
        );
        let c = DraftConfig::from_json_str(&lin).unwrap();
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        // partial rotary
        let p = ZLAB.replace(r#""rope_scaling": null"#, r#""partial_rotary_factor": 0.5"#);
        let c = DraftConfig::from_json_str(&p).unwrap();
        assert_eq!(c.rope.rot_dim, 64);
        assert_eq!(c.rope.spec().rot_dim(), 64);
        // llama3
        let l3 = ZLAB.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        );
        assert!(matches!(
            DraftConfig::from_json_str(&l3).unwrap().rope.scaling,
            RopeScaling::Llama3 { .. }
        ));
        // unsupported type
        let dy = ZLAB.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"rope_type": "dynamic", "factor": 2.0}"#,
        );
        assert!(matches!(
            DraftConfig::from_json_str(&dy),
            Err(ConfigParseError::Config(DraftError::Unsupported { .. }))
        ));
        // per-layer-type rope parameters
        let pl = ZLAB.replace(
            r#""rope_theta": 1000000,"#,
            r#""rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},"#,
        );
        let c = DraftConfig::from_json_str(&pl).unwrap();
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.rope_sliding.as_ref().unwrap().theta, 1e4);
    }

    #[test]
    fn missing_and_invalid_keys() {
        let no_hidden = ZLAB.replace(r#""hidden_size": 4096,"#, "");
        match DraftConfig::from_json_str(&no_hidden) {
            Err(ConfigParseError::Config(DraftError::MissingKey(k))) => {
                assert_eq!(k, "hidden_size")
            }
            other => panic!("{other:?}"),
        }
        let no_mask = ZLAB.replace(r#""mask_token_id": 151669, "#, "");
        match DraftConfig::from_json_str(&no_mask) {
            Err(ConfigParseError::Config(DraftError::MissingKey(k))) => {
                assert_eq!(k, "dflash_config.mask_token_id")
            }
            other => panic!("{other:?}"),
        }
        let no_block = ZLAB.replace(r#""block_size": 16,"#, "");
        assert!(matches!(
            DraftConfig::from_json_str(&no_block),
            Err(ConfigParseError::Config(DraftError::MissingKey(_)))
        ));
        let bad_mask = ZLAB.replace("151669", "151936");
        assert!(matches!(
            DraftConfig::from_json_str(&bad_mask),
            Err(ConfigParseError::Config(DraftError::InvalidConfig { .. }))
        ));
        let last_layer_tap = ZLAB.replace("[1, 9, 17, 25, 33]", "[1, 9, 17, 25, 35]");
        assert!(matches!(
            DraftConfig::from_json_str(&last_layer_tap),
            Err(ConfigParseError::Config(DraftError::InvalidConfig { .. }))
        ));
        let wrong_type = ZLAB.replace(r#""hidden_size": 4096"#, r#""hidden_size": "big""#);
        assert!(matches!(
            DraftConfig::from_json_str(&wrong_type),
            Err(ConfigParseError::Json(_))
        ));
        assert!(matches!(
            DraftConfig::from_json_str("{not json"),
            Err(ConfigParseError::Json(_))
        ));
    }
}

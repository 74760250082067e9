//! The shape of a Qwen3.5 / Qwen3-Next hybrid model, read from a transformers 5.17 config.

use dflash_backend::RopeSpec;
use serde_json::Value;

use crate::config::Cfg;
use crate::{Result, TargetError};

/// Token mixer of one decoder layer (transformers `layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// `linear_attention`: Gated DeltaNet with its short causal conv.
    Linear,
    /// `full_attention`: gated softmax attention over a KV cache.
    Full,
}

/// Which transformers family the config describes (decides the tensor layout of the Gated
/// DeltaNet projections and which layers carry a sparse MoE MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HybridArch {
    /// `qwen3_5_text` / `qwen3_5` (vision-language, text part): separate `in_proj_qkv`,
    /// `in_proj_z`, `in_proj_b`, `in_proj_a`; dense MLP.
    Qwen3_5,
    /// `qwen3_5_moe_text` / `qwen3_5_moe`: as Qwen3.5 with a sparse MoE MLP in every layer.
    Qwen3_5Moe,
    /// `qwen3_next`: fused, per-key-head interleaved `in_proj_qkvz` / `in_proj_ba`; sparse MoE
    /// MLP where `num_experts > 0`, the layer is not in `mlp_only_layers` and
    /// `(layer + 1) % decoder_sparse_step == 0`.
    Qwen3Next,
}

/// The sparse MoE MLP of Qwen3-Next / Qwen3.5-MoE: a softmax top-k router over `n_experts`
/// SwiGLU experts plus a shared SwiGLU expert scaled by `sigmoid(shared_expert_gate · x)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `moe_intermediate_size` (each routed expert).
    pub intermediate: usize,
    /// `shared_expert_intermediate_size`.
    pub shared_intermediate: usize,
    /// Renormalise the top-k probabilities to sum to 1 (`norm_topk_prob`; always for Qwen3.5-MoE).
    pub norm_topk: bool,
}

/// The shape of a hybrid model.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    pub arch: HybridArch,
    pub vocab: usize,
    pub hidden: usize,
    /// Dense MLP width (`intermediate_size`; 0 when every layer is MoE and the key is absent).
    pub intermediate: usize,
    pub n_layers: usize,
    /// Full-attention query heads, KV heads and head width.
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    /// Partial rotary: `rope.inv_freq.len() * 2` leading dims of each head rotate.
    pub rope: RopeSpec,
    pub tie_embeddings: bool,
    pub layer_kinds: Vec<LayerKind>,
    /// Per layer: the MLP is the sparse MoE block of `moe`.
    pub moe_layers: Vec<bool>,
    /// Shape of the MoE blocks (`Some` whenever a layer is MoE).
    pub moe: Option<MoeConfig>,
    /// Gated DeltaNet key heads, value heads, key width, value width, conv kernel.
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_dk: usize,
    pub lin_dv: usize,
    pub conv_kernel: usize,
    pub max_positions: usize,
}

impl HybridConfig {
    /// Channels of the depthwise conv (q, k and v concatenated): `2·nk·dk + nv·dv`.
    pub fn conv_channels(&self) -> usize {
        2 * self.lin_k_heads * self.lin_dk + self.lin_v_heads * self.lin_dv
    }

    /// Width of the Gated DeltaNet value / output (`nv·dv`).
    pub fn lin_value_dim(&self) -> usize {
        self.lin_v_heads * self.lin_dv
    }

    /// Parse a `config.json` value: a text config (`qwen3_5_text`, `qwen3_next`, ...) or a
    /// vision-language config whose `text_config` holds the text fields (`qwen3_5`).
    pub fn from_json(path: &str, root: &Value) -> Result<Self> {
        let root_cfg = Cfg::new(path.to_string(), root);
        let root_type = root_cfg.str_or("model_type", "")?.to_string();
        let nested = root_cfg.get("text_config").is_some();
        let (text, text_path) = match root_cfg.get("text_config") {
            Some(t) => (t, format!("{path} (text_config)")),
            None => (root, path.to_string()),
        };
        let c = Cfg::new(text_path, text);
        let text_type = c.str_or("model_type", &root_type)?.to_string();
        let arch = match text_type.as_str() {
            "qwen3_5_text" | "qwen3_5" => HybridArch::Qwen3_5,
            "qwen3_5_moe_text" | "qwen3_5_moe" => HybridArch::Qwen3_5Moe,
            "qwen3_next" => HybridArch::Qwen3Next,
            other => {
                return Err(TargetError::Unsupported(format!(
                    "{path}: model_type `{other}` is not a Qwen3.5 / Qwen3-Next hybrid"
                )))
            }
        };
        let hidden = c.usize("hidden_size")?;
        let n_layers = c.usize("num_hidden_layers")?;
        let n_heads = c.usize("num_attention_heads")?;
        let head_dim = match c.get("head_dim") {
            Some(_) => c.usize("head_dim")?,
            None => hidden / n_heads.max(1),
        };
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
        let cfg_err = |msg: String| TargetError::Config {
            path: c.path.clone(),
            msg,
        };
        let types = match c.strings("layer_types")? {
            Some(t) => t,
            None => {
                let interval = c.usize_or("full_attention_interval", 4)?;
                if interval == 0 {
                    return Err(cfg_err("full_attention_interval is 0".into()));
                }
                (0..n_layers)
                    .map(|i| {
                        if (i + 1) % interval != 0 {
                            "linear_attention".to_string()
                        } else {
                            "full_attention".to_string()
                        }
                    })
                    .collect()
            }
        };
        if types.len() != n_layers {
            return Err(cfg_err(format!(
                "layer_types has {} entries, num_hidden_layers is {n_layers}",
                types.len()
            )));
        }
        let layer_kinds = types
            .iter()
            .map(|t| match t.as_str() {
                // transformers' `remap_legacy_layer_types`
                "linear_attention" | "mamba" | "conv" => Ok(LayerKind::Linear),
                "full_attention" | "attention" => Ok(LayerKind::Full),
                other => Err(TargetError::Unsupported(format!(
                    "{}: layer type `{other}` in a hybrid Qwen3.5 / Qwen3-Next model",
                    c.path
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        let moe_layers = match arch {
            HybridArch::Qwen3_5 => vec![false; n_layers],
            HybridArch::Qwen3_5Moe => vec![true; n_layers],
            HybridArch::Qwen3Next => {
                let n_experts = c.usize_or("num_experts", 512)?;
                let step = c.usize_or("decoder_sparse_step", 1)?;
                let mlp_only: Vec<usize> = match c.get("mlp_only_layers") {
                    None => Vec::new(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|x| {
                            x.as_u64().map(|v| v as usize).ok_or_else(|| {
                                cfg_err(format!("mlp_only_layers holds a non-integer: {x}"))
                            })
                        })
                        .collect::<Result<_>>()?,
                    Some(v) => return Err(cfg_err(format!("mlp_only_layers is not a list: {v}"))),
                };
                (0..n_layers)
                    .map(|i| {
                        !mlp_only.contains(&i) && n_experts > 0 && step > 0 && (i + 1) % step == 0
                    })
                    .collect()
            }
        };
        let moe = if moe_layers.iter().any(|&m| m) {
            let (n_experts, top_k) = match arch {
                HybridArch::Qwen3Next => (512, 10),
                _ => (256, 8),
            };
            Some(MoeConfig {
                n_experts: c.usize_or("num_experts", n_experts)?,
                top_k: c.usize_or("num_experts_per_tok", top_k)?,
                intermediate: c.usize_or("moe_intermediate_size", 512)?,
                shared_intermediate: c.usize_or("shared_expert_intermediate_size", 512)?,
                norm_topk: arch == HybridArch::Qwen3_5Moe || c.bool_or("norm_topk_prob", true)?,
            })
        } else {
            None
        };
        // Tied embeddings: the vision-language wrapper has its own flag.
        let tie_embeddings = match root_cfg.get("tie_word_embeddings") {
            Some(_) if nested => root_cfg.bool_or("tie_word_embeddings", false)?,
            _ => c.bool_or("tie_word_embeddings", false)?,
        };
        // transformers' `__post_init__` defaults `partial_rotary_factor` to 0.25 for these
        // families when neither `rope_parameters` nor the top level gives one.
        let rope = if c.get("partial_rotary_factor").is_none() {
            let mut patched = text.clone();
            if let Value::Object(m) = &mut patched {
                m.insert("partial_rotary_factor".into(), Value::from(0.25));
            }
            Cfg::new(c.path.clone(), &patched).rope(head_dim)?
        } else {
            c.rope(head_dim)?
        };
        let cfg = HybridConfig {
            arch,
            vocab: c.usize("vocab_size")?,
            hidden,
            intermediate: if moe_layers.iter().all(|&m| m) {
                c.usize_or("intermediate_size", 0)?
            } else {
                c.usize("intermediate_size")?
            },
            n_layers,
            n_heads,
            n_kv_heads: c.usize_or("num_key_value_heads", n_heads)?,
            head_dim,
            rms_eps: c.f64_or("rms_norm_eps", 1e-6)? as f32,
            rope,
            tie_embeddings,
            layer_kinds,
            moe,
            moe_layers,
            lin_k_heads: c.usize_or("linear_num_key_heads", 16)?,
            lin_v_heads: c.usize_or("linear_num_value_heads", 32)?,
            lin_dk: c.usize_or("linear_key_head_dim", 128)?,
            lin_dv: c.usize_or("linear_value_head_dim", 128)?,
            conv_kernel: c.usize_or("linear_conv_kernel_dim", 4)?,
            max_positions: c.usize_or("max_position_embeddings", 32768)?,
        };
        cfg.validate(&c.path)?;
        Ok(cfg)
    }

    /// Check the divisibility rules the forward relies on.
    pub fn validate(&self, path: &str) -> Result<()> {
        let err = |msg: String| TargetError::Config {
            path: path.to_string(),
            msg,
        };
        let pos = [
            ("vocab_size", self.vocab),
            ("hidden_size", self.hidden),
            ("num_hidden_layers", self.n_layers),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.lin_k_heads),
            ("linear_num_value_heads", self.lin_v_heads),
            ("linear_key_head_dim", self.lin_dk),
            ("linear_value_head_dim", self.lin_dv),
            ("linear_conv_kernel_dim", self.conv_kernel),
        ];
        for (k, v) in pos {
            if v == 0 {
                return Err(err(format!("`{k}` must be positive")));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.n_heads, self.n_kv_heads
            )));
        }
        if !self.lin_v_heads.is_multiple_of(self.lin_k_heads) {
            return Err(err(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                self.lin_v_heads, self.lin_k_heads
            )));
        }
        if self.rope.rot_dim() > self.head_dim {
            return Err(err(format!(
                "rotary dim {} exceeds head_dim {}",
                self.rope.rot_dim(),
                self.head_dim
            )));
        }
        if self.layer_kinds.len() != self.n_layers || self.moe_layers.len() != self.n_layers {
            return Err(err(
                "layer_types length differs from num_hidden_layers".into()
            ));
        }
        if self.moe_layers.iter().any(|&m| !m) && self.intermediate == 0 {
            return Err(err(
                "`intermediate_size` must be positive for dense-MLP layers".into(),
            ));
        }
        if self.moe_layers.iter().any(|&m| m) {
            let m = self
                .moe
                .ok_or_else(|| err("MoE layers without an MoE shape".into()))?;
            if m.n_experts == 0 || m.top_k == 0 || m.top_k > m.n_experts {
                return Err(err(format!(
                    "num_experts_per_tok {} must be in 1..=num_experts {}",
                    m.top_k, m.n_experts
                )));
            }
            if m.intermediate == 0 || m.shared_intermediate == 0 {
                return Err(err(
                    "moe_intermediate_size and shared_expert_intermediate_size must be positive"
                        .into(),
                ));
            }
        }
        Ok(())
    }
}

//! Random tiny drafters for tests in other crates (feature `random`).
//!
//! Weights are uniform in `±1/sqrt(fan_in)` (linear layers), norms in `[0.5, 1.5]`, so
//! activations stay O(1) through a few layers; deterministic in `seed`.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::checkpoint::TensorMap;
use crate::config::{ConfigParseError, DraftConfig};
use crate::error::{DraftError, Result};

/// A tensor map holding every tensor [`DraftConfig::expected_tensors`] lists, random.
pub fn random_tensor_map(cfg: &DraftConfig, seed: u64) -> TensorMap {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut map = TensorMap::new();
    for (name, shape) in cfg.expected_tensors() {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = if shape.len() == 1 && !name.ends_with(".bias") {
            (0..n).map(|_| rng.random_range(0.5f32..1.5)).collect()
        } else {
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            let a = 1.0 / fan_in.max(1.0).sqrt();
            (0..n).map(|_| rng.random_range(-a..a)).collect()
        };
        map.insert(name, (shape, vals));
    }
    map
}

/// A tiny z-lab style config (all full-attention layers unless `window` is given, in which
/// case layers alternate sliding / full, starting with sliding).
#[allow(clippy::too_many_arguments)]
pub fn tiny_config(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    block: usize,
    taps: &[i64],
    window: Option<usize>,
    markov_rank: usize,
) -> Result<DraftConfig> {
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| {
            if window.is_some() && i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let mut v = serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden / heads,
        "intermediate_size": 2 * hidden,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "block_size": block,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": taps},
        "layer_types": layer_types,
        "sliding_window": window,
    });
    if markov_rank > 0 {
        v["markov_rank"] = markov_rank.into();
        v["enable_confidence_head"] = true.into();
        v["confidence_head_with_markov"] = true.into();
    }
    DraftConfig::from_json_str(&v.to_string()).map_err(|e| match e {
        ConfigParseError::Config(e) => e,
        ConfigParseError::Json(e) => DraftError::Invalid(e.to_string()),
    })
}

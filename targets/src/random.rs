//! Random tiny models for tests and benches (seeded, reproducible).

use dflash_backend::{Backend, HostWeight, RopeSpec, WeightFormat};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::qwen3::{HostTensor, Qwen3Config, Qwen3Dense};
use crate::Result;

/// A small Qwen3 shape: `vocab`, `hidden`, `n_layers`; 4 query heads, 2 KV heads, head_dim
/// `hidden / 4`, intermediate `2 * hidden`, theta 10000; `window` makes every odd layer a
/// sliding-window layer.
pub fn tiny_qwen3_config(
    vocab: usize,
    hidden: usize,
    n_layers: usize,
    window: Option<usize>,
) -> Qwen3Config {
    let head_dim = hidden / 4;
    let inv_freq = (0..head_dim / 2)
        .map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    Qwen3Config {
        vocab,
        hidden,
        intermediate: 2 * hidden,
        n_layers,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim,
        rms_eps: 1e-6,
        rope: RopeSpec {
            inv_freq,
            attention_scaling: 1.0,
        },
        tie_embeddings: false,
        windows: (0..n_layers)
            .map(|i| if i % 2 == 1 { window } else { None })
            .collect(),
        max_positions: 4096,
    }
}

/// A Qwen3 dense model with uniform random weights (matrices in `±sqrt(3/in)`, the
/// embedding and lm_head in `±1`), stored in `format`.
pub fn random_qwen3<B: Backend>(
    be: &B,
    cfg: Qwen3Config,
    seed: u64,
    format: WeightFormat,
    cap: usize,
) -> Result<Qwen3Dense<B>> {
    random_qwen3_steered(be, cfg, seed, format, cap, None)
}

/// [`random_qwen3`] steered towards one token: every embedding row gets `+4` in dimension 0
/// (a direction the residual stream keeps) and the lm_head row of `steer.0` gets `steer.1` in
/// dimension 0, so the greedy stream picks that token often but not always. A drafter that
/// borrows this embedding and lm_head drafts it often too: long accepts for tests.
pub fn random_qwen3_steered<B: Backend>(
    be: &B,
    cfg: Qwen3Config,
    seed: u64,
    format: WeightFormat,
    cap: usize,
    steer: Option<(u32, f32)>,
) -> Result<Qwen3Dense<B>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut get = |name: &str, shape: &[usize]| -> Result<HostTensor> {
        if shape.len() == 1 {
            let v = (0..shape[0])
                .map(|_| 0.8 + 0.4 * rng.random::<f32>())
                .collect();
            return Ok(HostTensor::Vector(v));
        }
        let (rows, cols) = (shape[0], shape[1]);
        let s = if name.contains("embed") || name.contains("lm_head") {
            1.0
        } else {
            (3.0 / cols as f32).sqrt()
        };
        let mut v: Vec<f32> = (0..rows * cols)
            .map(|_| s * (2.0 * rng.random::<f32>() - 1.0))
            .collect();
        if let Some((tok, strength)) = steer {
            if name.contains("embed") {
                for r in 0..rows {
                    v[r * cols] += 4.0;
                }
            } else if name.contains("lm_head") && (tok as usize) < rows {
                v[tok as usize * cols] += strength;
            }
        }
        Ok(HostTensor::Matrix(HostWeight::from_f32(
            name, rows, cols, &v, format,
        )?))
    };
    Qwen3Dense::from_host(be, cfg, &mut get, cap)
}

//! Rotary position embedding parameters: default, linear, llama3 and YaRN, computed exactly as
//! transformers' `modeling_rope_utils` does (`_compute_*_parameters`), reduced to the
//! per-pair inverse frequencies and post-rope scale of [`dflash_backend::RopeSpec`].
//!
//! Frequencies are computed in f64 and rounded once to f32 (transformers computes them in f32;
//! the two differ by at most one f32 ulp per frequency).

use dflash_backend::RopeSpec;

use crate::error::{DraftError, Result};

/// The scaling variant of a rotary embedding (`rope_scaling` / `rope_parameters.rope_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq_i = theta^(-2i/dim)`.
    Default,
    /// Position interpolation: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1 frequency-band scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (NTK-by-parts + attention temperature), as HF `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        /// `beta_fast` (HF: `cfg.beta_fast or 32`).
        beta_fast: f64,
        /// `beta_slow` (HF: `cfg.beta_slow or 1`).
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        /// Explicit `attention_factor`; derived from `factor` / `mscale` when absent.
        attention_factor: Option<f64>,
        /// Round the correction range to integers (HF default `true`).
        truncate: bool,
    },
}

/// Everything needed to build a [`RopeSpec`].
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    /// Base wavelength θ (`rope_theta`).
    pub theta: f64,
    /// Number of rotated dimensions per head: `int(head_dim * partial_rotary_factor)`.
    pub rot_dim: usize,
    pub scaling: RopeScaling,
}

/// YaRN's attention temperature helper: `0.1 · m · ln(s) + 1` for `s > 1`, else 1.
pub fn yarn_get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// YaRN correction range `(low, high)` of HF `find_correction_range` (before the ramp's
/// `low == high` nudge).
pub fn yarn_correction_range(
    beta_fast: f64,
    beta_slow: f64,
    dim: usize,
    theta: f64,
    original_max_position_embeddings: f64,
    truncate: bool,
) -> (f64, f64) {
    let corr = |rot: f64| {
        (dim as f64) * (original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

impl RopeConfig {
    /// YaRN `attention_factor` (1.0 for the other variants).
    pub fn attention_factor(&self) -> f64 {
        match &self.scaling {
            RopeScaling::Yarn {
                factor,
                mscale,
                mscale_all_dim,
                attention_factor,
                ..
            } => {
                if let Some(a) = attention_factor {
                    return *a;
                }
                // HF: `if mscale and mscale_all_dim` (both present and non-zero).
                match (mscale, mscale_all_dim) {
                    (Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => {
                        yarn_get_mscale(*factor, *m) / yarn_get_mscale(*factor, *ma)
                    }
                    _ => yarn_get_mscale(*factor, 1.0),
                }
            }
            _ => 1.0,
        }
    }

    /// The inverse frequencies in f64 (length `rot_dim / 2`).
    pub fn inv_freq_f64(&self) -> Vec<f64> {
        let dim = self.rot_dim;
        let half = dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f64 / dim as f64))
            .collect();
        match &self.scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (original_max_position_embeddings / wavelen
                                - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (low, mut high) = yarn_correction_range(
                    *beta_fast,
                    *beta_slow,
                    dim,
                    self.theta,
                    *original_max_position_embeddings,
                    *truncate,
                );
                if low == high {
                    high += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &ext)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let e = 1.0 - ramp;
                        let int = ext / factor;
                        int * (1.0 - e) + ext * e
                    })
                    .collect()
            }
        }
    }

    /// The backend's rope parameters.
    pub fn spec(&self) -> RopeSpec {
        RopeSpec {
            inv_freq: self.inv_freq_f64().iter().map(|&f| f as f32).collect(),
            attention_scaling: self.attention_factor() as f32,
        }
    }

    /// Check the numbers make sense (positive theta, even rot_dim, factors > 0).
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let bad = |key: &str, msg: String| {
            Err(DraftError::InvalidConfig {
                key: key.into(),
                msg,
            })
        };
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return bad(
                "rope_theta",
                format!("must be finite and > 1, found {}", self.theta),
            );
        }
        if self.rot_dim == 0 || !self.rot_dim.is_multiple_of(2) || self.rot_dim > head_dim {
            return bad(
                "partial_rotary_factor",
                format!(
                    "rotary dimension {} must be even, non-zero and <= head_dim {head_dim}",
                    self.rot_dim
                ),
            );
        }
        let pos = |key: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                bad(key, format!("must be finite and > 0, found {v}"))
            }
        };
        match &self.scaling {
            RopeScaling::Default => Ok(()),
            RopeScaling::Linear { factor } => pos("rope_scaling.factor", *factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                pos("rope_scaling.factor", *factor)?;
                pos("rope_scaling.low_freq_factor", *low_freq_factor)?;
                pos("rope_scaling.high_freq_factor", *high_freq_factor)?;
                pos(
                    "rope_scaling.original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                if high_freq_factor <= low_freq_factor {
                    return bad(
                        "rope_scaling.high_freq_factor",
                        format!("must exceed low_freq_factor {low_freq_factor}, found {high_freq_factor}"),
                    );
                }
                Ok(())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                ..
            } => {
                pos("rope_scaling.factor", *factor)?;
                pos(
                    "rope_scaling.original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                pos("rope_scaling.beta_fast", *beta_fast)?;
                pos("rope_scaling.beta_slow", *beta_slow)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(theta: f64, dim: usize, factor: f64, orig: f64, truncate: bool) -> RopeConfig {
        RopeConfig {
            theta,
            rot_dim: dim,
            scaling: RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: None,
                mscale_all_dim: None,
                attention_factor: None,
                truncate,
            },
        }
    }

    // Reference numbers of dflash-semantics.md §6.
    #[test]
    fn yarn_reference_qwen3_long_context() {
        let c = yarn(1e6, 128, 4.0, 32768.0, true);
        assert_eq!(
            yarn_correction_range(32.0, 1.0, 128, 1e6, 32768.0, true),
            (23.0, 40.0)
        );
        assert!((c.attention_factor() - 1.1386294361).abs() < 1e-10);
    }

    #[test]
    fn yarn_reference_qwen36_early() {
        let c = yarn(1e7, 128, 64.0, 4096.0, true);
        assert_eq!(
            yarn_correction_range(32.0, 1.0, 128, 1e7, 4096.0, true),
            (11.0, 26.0)
        );
        assert!((c.attention_factor() - 1.4158883083).abs() < 1e-10);
    }

    #[test]
    fn yarn_reference_gpt_oss_shape() {
        let c = yarn(150000.0, 64, 32.0, 4096.0, true);
        assert_eq!(
            yarn_correction_range(32.0, 1.0, 64, 150000.0, 4096.0, true),
            (8.0, 18.0)
        );
        assert!((c.attention_factor() - 1.3465735903).abs() < 1e-10);
        // truncate = false keeps the fractional range.
        let (lo, hi) = yarn_correction_range(32.0, 1.0, 64, 150000.0, 4096.0, false);
        assert!(lo > 8.0 && lo < 9.0, "{lo}");
        assert!(hi > 17.0 && hi < 18.0, "{hi}");
    }

    #[test]
    fn yarn_inv_freq_bands() {
        // Below `low` the frequency is the unscaled one, above `high` it is divided by the
        // factor, in between it is the linear blend.
        let c = yarn(1e6, 128, 4.0, 32768.0, true);
        let f = c.inv_freq_f64();
        assert_eq!(f.len(), 64);
        for (i, &v) in f.iter().enumerate() {
            let ext = 1.0 / 1e6f64.powf(2.0 * i as f64 / 128.0);
            if i <= 23 {
                assert_eq!(v, ext, "i={i}");
            } else if i >= 40 {
                assert!((v - ext / 4.0).abs() <= 1e-18 + 1e-15 * ext, "i={i}");
            } else {
                let r = (i as f64 - 23.0) / 17.0;
                let want = ext / 4.0 * r + ext * (1.0 - r);
                assert!((v - want).abs() <= 1e-15 * ext, "i={i}");
            }
        }
    }

    #[test]
    fn yarn_mscale_variants() {
        let mut c = yarn(1e4, 64, 40.0, 4096.0, true);
        if let RopeScaling::Yarn {
            mscale,
            mscale_all_dim,
            ..
        } = &mut c.scaling
        {
            *mscale = Some(0.707);
            *mscale_all_dim = Some(0.707);
        }
        // DeepSeek-V3 style: equal mscales cancel.
        assert!((c.attention_factor() - 1.0).abs() < 1e-15);
        if let RopeScaling::Yarn {
            mscale,
            mscale_all_dim,
            ..
        } = &mut c.scaling
        {
            *mscale = Some(1.0);
            *mscale_all_dim = Some(0.0); // falsy: falls back to get_mscale(factor)
        }
        assert!((c.attention_factor() - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-15);
        if let RopeScaling::Yarn {
            attention_factor, ..
        } = &mut c.scaling
        {
            *attention_factor = Some(0.5);
        }
        assert_eq!(c.attention_factor(), 0.5);
        assert_eq!(c.spec().attention_scaling, 0.5);
    }

    #[test]
    fn default_linear_llama3() {
        let d = RopeConfig {
            theta: 10000.0,
            rot_dim: 8,
            scaling: RopeScaling::Default,
        };
        let f = d.inv_freq_f64();
        assert_eq!(f, vec![1.0, 0.1, 0.01, 0.001]);
        assert_eq!(d.spec().rot_dim(), 8);
        assert_eq!(d.spec().attention_scaling, 1.0);
        let l = RopeConfig {
            scaling: RopeScaling::Linear { factor: 2.0 },
            ..d.clone()
        };
        assert_eq!(l.inv_freq_f64(), vec![0.5, 0.05, 0.005, 0.0005]);
        // Llama 3.1 8B: theta 5e5, dim 128, factor 8, 1/4, original 8192.
        let ll = RopeConfig {
            theta: 500000.0,
            rot_dim: 128,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
        };
        let base = RopeConfig {
            scaling: RopeScaling::Default,
            ..ll.clone()
        }
        .inv_freq_f64();
        let f = ll.inv_freq_f64();
        for (i, (&v, &b)) in f.iter().zip(&base).enumerate() {
            let wl = 2.0 * std::f64::consts::PI / b;
            if wl < 8192.0 / 4.0 {
                assert_eq!(v, b, "high-frequency band unchanged at {i}");
            } else if wl > 8192.0 {
                assert_eq!(v, b / 8.0, "low-frequency band divided at {i}");
            } else {
                assert!(v < b && v > b / 8.0, "blend band at {i}");
            }
        }
        // The first pair is always unscaled, the last divided by 8 at these settings.
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], base[63] / 8.0);
    }

    /// Values printed by transformers 5.17 `ROPE_INIT_FUNCTIONS[...]` (f32 tensors) for the
    /// same parameters; ours are computed in f64 and rounded once, so a few f32 ulps apart.
    #[test]
    fn matches_transformers_5_17() {
        fn check(c: &RopeConfig, att: f64, pts: &[(usize, f64)]) {
            let s = c.spec();
            assert!(
                (s.attention_scaling as f64 - att).abs() < 1e-6,
                "{} vs {att}",
                s.attention_scaling
            );
            for &(i, want) in pts {
                let got = s.inv_freq[i] as f64;
                assert!((got - want).abs() <= 1e-6 * want, "i={i}: {got} vs {want}");
            }
        }
        check(
            &yarn(1e6, 128, 4.0, 32768.0, true),
            1.138629436111989,
            &[
                (0, 1.0),
                (1, 0.8058422207832336),
                (10, 0.11547820270061493),
                (23, 0.006978305988013744),
                (24, 0.005375321488827467),
                (30, 0.0010643609566614032),
                (39, 6.490394298452884e-05),
                (40, 4.4456985051510856e-05),
                (63, 3.102344408034696e-07),
            ],
        );
        check(
            &yarn(150000.0, 64, 32.0, 4096.0, false),
            1.3465735902799727,
            &[
                (0, 1.0),
                (5, 0.15532298386096954),
                (8, 0.05081327259540558),
                (9, 0.031705696135759354),
                (12, 0.006794959306716919),
                (17, 0.00012931869423482567),
                (18, 3.830881178146228e-05),
                (31, 3.023511396804679e-07),
            ],
        );
        let mut c = yarn(1e4, 64, 40.0, 4096.0, true);
        if let RopeScaling::Yarn {
            mscale,
            mscale_all_dim,
            ..
        } = &mut c.scaling
        {
            *mscale = Some(1.0);
            *mscale_all_dim = Some(0.707);
        }
        check(
            &c,
            1.0857263992561355,
            &[
                (0, 1.0),
                (5, 0.23713736236095428),
                (8, 0.10000000149011612),
                (9, 0.07498941570520401),
                (12, 0.026879360899329185),
                (17, 0.0035619973205029964),
                (18, 0.002249365206807852),
                (31, 3.3338035336782923e-06),
            ],
        );
        let l3 = RopeConfig {
            theta: 500000.0,
            rot_dim: 128,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
        };
        check(
            &l3,
            1.0,
            &[
                (0, 1.0),
                (1, 0.8146172165870667),
                (10, 0.12868738174438477),
                (23, 0.008952259086072445),
                (24, 0.00729266507551074),
                (30, 0.0013718936825171113),
                (39, 4.208236714475788e-05),
                (40, 3.428102354519069e-05),
                (63, 3.068925877869333e-07),
            ],
        );
    }

    #[test]
    fn validate_rejects_bad_values() {
        let d = RopeConfig {
            theta: 10000.0,
            rot_dim: 7,
            scaling: RopeScaling::Default,
        };
        assert!(d.validate(8).is_err());
        let d = RopeConfig {
            theta: 0.5,
            rot_dim: 8,
            scaling: RopeScaling::Default,
        };
        assert!(d.validate(8).is_err());
        let d = RopeConfig {
            theta: 1e4,
            rot_dim: 8,
            scaling: RopeScaling::Linear { factor: 0.0 },
        };
        assert!(d.validate(8).is_err());
    }
}

//! Shared helpers of the GPU tests: the device (or a printed skip), seeded random data,
//! poisoned outputs and error metrics.
#![allow(dead_code)]

use std::sync::OnceLock;

use dflash_backend::Backend;
use dflash_cuda_kernels::{Cuda, CudaBuf};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

static GPU: OnceLock<Option<Cuda>> = OnceLock::new();

/// The shared CUDA backend, or `None` after printing why the test is skipped.
pub fn gpu(test: &str) -> Option<&'static Cuda> {
    let g = GPU.get_or_init(|| match Cuda::new(0) {
        Ok(c) => match c.warm_up() {
            Ok(()) => {
                // `Backend::scratch` values an op reads before it writes them become NaN.
                c.set_poison_scratch(true);
                Some(c)
            }
            Err(e) => panic!("CUDA device present but the kernels failed to load: {e}"),
        },
        Err(e) => {
            eprintln!("no usable CUDA device: {e}");
            None
        }
    });
    if g.is_none() {
        eprintln!("SKIPPED {test}: no usable CUDA device on this machine");
    }
    g.as_ref()
}

/// A fresh seed per run (printed, so a failure can be replayed with DFLASH_TEST_SEED).
/// A CUDA backend of the test's own (for knobs that would change other tests' bits), or
/// None where [`gpu`] finds no device (it prints why).
pub fn private_gpu(test: &str) -> Option<Cuda> {
    gpu(test)?;
    Some(Cuda::new(0).expect("second CUDA backend"))
}

pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("DFLASH_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{test}: seed {seed}");
    StdRng::seed_from_u64(seed)
}

pub fn rand_vec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// A device buffer of `n` NaNs: every value an op should write must be overwritten.
pub fn poisoned(gpu: &Cuda, n: usize) -> CudaBuf {
    let mut b = gpu.zeros(n).expect("alloc");
    gpu.fill(&mut b, f32::NAN).expect("fill");
    b
}

/// max |a - b| / max(|b|) over the first `n` values; NaN anywhere gives +inf.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    let mut e = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        if !x.is_finite() || !y.is_finite() {
            return f32::INFINITY;
        }
        e = e.max((x - y).abs());
    }
    e / scale
}

/// Compare, print and assert.
pub fn report(op: &str, gpu_v: &[f32], cpu_v: &[f32], tol: f32) {
    let e = rel_err(gpu_v, cpu_v);
    eprintln!(
        "PARITY {op:<48} max rel err {e:.3e} (tol {tol:.0e}, {} values)",
        gpu_v.len()
    );
    assert!(e <= tol, "{op}: max relative error {e:e} exceeds {tol:e}");
}

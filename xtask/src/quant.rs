//! `parity quant` and `bench quant`: the dflash-quant codecs against gguf==0.19.0.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_quant::{BlockQ4_0, BlockQ8_0, QK};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::{run_python, Scratch};

#[derive(Args)]
pub struct ParityArgs {
    /// Blocks of 32 values per data kind (raw f32 and bf16-origin).
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// RNG seed (default: fresh from the clock; printed so a failure can be replayed).
    #[arg(long)]
    seed: Option<u64>,
}

#[derive(Args)]
pub struct BenchArgs {
    /// MiB of f32 input (bf16-origin N(0, 0.02) weights).
    #[arg(long, default_value_t = 32)]
    mib: usize,
    /// Minimum seconds per measurement (median of the runs is reported).
    #[arg(long, default_value_t = 0.5)]
    min_secs: f64,
}

// ---------------------------------------------------------------------------------------
// Data

fn gauss(r: &mut StdRng) -> f32 {
    // Box-Muller
    let u1: f64 = r.random::<f64>().max(1e-300);
    let u2: f64 = r.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

fn log_uniform(r: &mut StdRng, lo: f64, hi: f64) -> f32 {
    10f64.powf(r.random_range(lo..hi)).min(3.0e38) as f32
}

fn to_bf16_origin(v: f32) -> f32 {
    let b = bf16::from_f32(v).to_f32();
    if b.is_finite() {
        b
    } else {
        // rounding past f32::MAX would give Inf: keep the truncated bf16 instead
        f32::from_bits(v.to_bits() & 0xFFFF_0000)
    }
}

/// One adversarial block of 32 finite values (the mix of quant-exactness.md §7, §8, §13).
fn gen_block(r: &mut StdRng, out: &mut [f32]) {
    let pick = r.random_range(0..100u32);
    match pick {
        // typical weights: gaussian at a log-uniform scale
        0..=39 => {
            let s = log_uniform(r, -4.0, 1.0);
            out.iter_mut().for_each(|v| *v = gauss(r) * s);
        }
        // any scale f32 can hold
        40..=49 => {
            let s = log_uniform(r, -38.0, 37.5);
            out.iter_mut().for_each(|v| *v = gauss(r) * s);
        }
        // half-integer multiples of a bf16 scale
        50..=59 => {
            let s = to_bf16_origin(log_uniform(r, -4.0, 1.0));
            out.iter_mut()
                .for_each(|v| *v = r.random_range(-254..=254) as f32 * 0.5 * s);
        }
        // exact q8_0 ties: d = 2^e
        60..=67 => {
            let s = 2f32.powi(r.random_range(-30..20));
            out.iter_mut()
                .for_each(|v| *v = (r.random_range(-127..127) as f32 + 0.5) * s);
            let p = r.random_range(0..QK);
            out[p] = if r.random() { 127.0 * s } else { -127.0 * s };
        }
        // exact q4_0 ties and signed-max ties
        68..=75 => {
            let s = 2f32.powi(r.random_range(-30..20));
            out.iter_mut()
                .for_each(|v| *v = (r.random_range(-8..8) as f32 + 0.5) * s);
            out[r.random_range(0..QK)] = 8.0 * s;
            if r.random() {
                out[r.random_range(0..QK)] = -8.0 * s;
            }
        }
        // signed zeros (the all-zero q4_0 case), sometimes one non-zero
        76..=79 => {
            out.iter_mut()
                .for_each(|v| *v = if r.random() { 0.0 } else { -0.0 });
            if r.random_range(0..3) == 0 {
                out[r.random_range(0..QK)] = gauss(r);
            }
        }
        // f32 subnormals, and scales around the 1/d overflow threshold
        80..=84 => {
            if r.random() {
                out.iter_mut()
                    .for_each(|v| *v = f32::from_bits(r.random::<u32>() & 0x807F_FFFF));
            } else {
                let s = log_uniform(r, -40.0, -34.0);
                out.iter_mut()
                    .for_each(|v| *v = r.random_range(-1.0..1.0f32) * s);
            }
        }
        // f16-subnormal / f16-zero / f16-overflow scales
        85..=89 => {
            let s = if r.random() {
                log_uniform(r, -9.0, -2.0)
            } else {
                log_uniform(r, 5.0, 7.5)
            };
            out.iter_mut()
                .for_each(|v| *v = r.random_range(-1.0..1.0f32) * s);
        }
        // t = +-(k + 0.49999997) with d = 1
        90..=94 => {
            let h = 0.499_999_97f32;
            out.iter_mut().for_each(|v| {
                let k = r.random_range(0..4) as f32 + h;
                *v = if r.random() { k } else { -k };
            });
            out[r.random_range(0..QK)] = if r.random() { 127.0 } else { -8.0 };
        }
        // small integers
        _ => out
            .iter_mut()
            .for_each(|v| *v = r.random_range(-40..=40) as f32 * 0.25),
    }
    for v in out.iter_mut() {
        if !v.is_finite() {
            *v = 0.0;
        }
    }
}

fn gen_data(seed: u64, blocks: usize, bf16_origin: bool) -> Vec<f32> {
    let mut r = StdRng::seed_from_u64(seed);
    let mut x = vec![0.0f32; blocks * QK];
    for b in x.chunks_exact_mut(QK) {
        gen_block(&mut r, b);
        if bf16_origin {
            b.iter_mut().for_each(|v| *v = to_bf16_origin(*v));
        }
    }
    x
}

fn write_f32(path: &std::path::Path, x: &[f32]) -> Result<()> {
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

// ---------------------------------------------------------------------------------------
// Parity

struct Tally {
    compared: usize,
    mismatches: usize,
    known_neg_zero: usize,
    examples: Vec<String>,
}

fn compare_records(
    x: &[f32],
    ours: &[u8],
    theirs: &[u8],
    rec: usize,
    vals_per_rec: usize,
    q4: bool,
) -> Tally {
    let mut t = Tally {
        compared: 0,
        mismatches: 0,
        known_neg_zero: 0,
        examples: vec![],
    };
    if ours.len() != theirs.len() {
        t.mismatches = usize::MAX;
        t.examples.push(format!(
            "length: ours {} bytes, gguf {} bytes",
            ours.len(),
            theirs.len()
        ));
        return t;
    }
    // count in blocks of 32 values
    let recs_per_block = QK / vals_per_rec;
    let block_bytes = rec * recs_per_block;
    for (i, (a, b)) in ours
        .chunks(block_bytes)
        .zip(theirs.chunks(block_bytes))
        .enumerate()
    {
        t.compared += 1;
        if a == b {
            continue;
        }
        let xb = &x[i * QK..(i + 1) * QK];
        let neg_zero_block = xb.iter().all(|&v| v == 0.0) && xb[0].is_sign_negative();
        if q4
            && neg_zero_block
            && a[..2] == [0x00, 0x80]
            && b[..2] == [0x00, 0x00]
            && a[2..] == b[2..]
        {
            // gguf-py's documented divergence from C (quant-exactness.md §7, §10)
            t.known_neg_zero += 1;
            continue;
        }
        t.mismatches += 1;
        if t.examples.len() < 5 {
            t.examples.push(format!(
                "block {i}: x = {:?}\n  ours {:02x?}\n  gguf {:02x?}",
                xb.iter()
                    .map(|v| v.to_bits())
                    .map(|b| format!("{b:#010x}"))
                    .collect::<Vec<_>>(),
                a,
                b
            ));
        }
    }
    t
}

pub fn parity(a: ParityArgs) -> Result<()> {
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let scratch = Scratch::new("parity-quant")?;
    println!(
        "parity quant: {} blocks per data kind, seed {seed}",
        a.blocks
    );
    println!(
        "{:<12} {:<6} {:>10} {:>11} {:>22}",
        "data", "format", "blocks", "mismatches", "known -0.0 q4_0 blocks"
    );
    let mut failed = false;
    for (kind, bf16_origin, kseed) in [
        ("raw_f32", false, seed),
        ("bf16_origin", true, seed ^ 0x5DEE_CE66_D1CE_4E5B),
    ] {
        let x = gen_data(kseed, a.blocks, bf16_origin);
        let input = scratch.0.join(format!("{kind}.f32"));
        write_f32(&input, &x)?;
        let prefix = scratch.0.join(kind);
        let info = run_python(
            "tools/quant/parity.py",
            &[input.display().to_string(), prefix.display().to_string()],
        )?;
        let info: serde_json::Value =
            serde_json::from_str(info.trim()).context("parity.py output")?;
        if info["gguf"] != "0.19.0" {
            bail!("the oracle is gguf==0.19.0, found {}", info["gguf"]);
        }
        let read = |ext: &str| -> Result<Vec<u8>> {
            let p = prefix.with_extension(ext);
            std::fs::read(&p).with_context(|| format!("reading {}", p.display()))
        };
        let q8 = dflash_quant::quantize_q8_0(&x)?;
        let q4 = dflash_quant::quantize_q4_0(&x)?;
        let b16 = dflash_quant::encode_bf16(&x)?;
        let h16 = dflash_quant::encode_f16(&x)?;
        let results = [
            (
                "q8_0",
                compare_records(
                    &x,
                    bytemuck::cast_slice::<BlockQ8_0, u8>(&q8),
                    &read("q8_0")?,
                    34,
                    QK,
                    false,
                ),
            ),
            (
                "q4_0",
                compare_records(
                    &x,
                    bytemuck::cast_slice::<BlockQ4_0, u8>(&q4),
                    &read("q4_0")?,
                    18,
                    QK,
                    true,
                ),
            ),
            (
                "bf16",
                compare_records(&x, bytemuck::cast_slice(&b16), &read("bf16")?, 2, 1, false),
            ),
            (
                "f16",
                compare_records(&x, bytemuck::cast_slice(&h16), &read("f16")?, 2, 1, false),
            ),
        ];
        for (fmt, t) in results {
            println!(
                "{kind:<12} {fmt:<6} {:>10} {:>11} {:>22}",
                t.compared, t.mismatches, t.known_neg_zero
            );
            for e in &t.examples {
                println!("    {e}");
            }
            failed |= t.mismatches != 0 || t.compared < a.blocks;
        }
    }
    println!(
        "(known -0.0 q4_0 blocks: all-zero blocks whose first value is -0.0, where gguf-py \
         stores d = +0.0 and ggml's C reference, like this crate, d = -0.0; not mismatches)"
    );
    if failed {
        bail!("parity quant: mismatches against gguf 0.19.0 (seed {seed})");
    }
    println!("parity quant: OK");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Bench

fn median_secs(min_secs: f64, mut f: impl FnMut()) -> f64 {
    f(); // warm up (page faults, caches)
    let mut ts = vec![];
    let start = Instant::now();
    while ts.len() < 3 || start.elapsed().as_secs_f64() < min_secs {
        let t = Instant::now();
        f();
        ts.push(t.elapsed().as_secs_f64());
    }
    ts.sort_by(f64::total_cmp);
    ts[ts.len() / 2]
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let n = (a.mib << 20) / 4 / QK * QK;
    if n == 0 {
        bail!("--mib must be at least 1");
    }
    let mut r = StdRng::seed_from_u64(7);
    let x: Vec<f32> = (0..n)
        .map(|_| to_bf16_origin(gauss(&mut r) * 0.02))
        .collect();
    let gb = (n * 4) as f64 / 1e9;
    let all = std::thread::available_parallelism()
        .map(|p| p.get())
        .unwrap_or(1);
    let mut threads = vec![1];
    if all > 1 {
        threads.push(all);
    }

    let scratch = Scratch::new("bench-quant")?;
    let input = scratch.0.join("bench.f32");
    write_f32(&input, &x)?;
    if let Ok(l) = std::fs::read_to_string("/proc/loadavg") {
        println!("load average before the run: {}", l.trim());
    }
    println!("bench quant: {} MiB of f32 input ({n} values, bf16-origin N(0, 0.02)), GB/s of f32 input (median)", a.mib);
    println!("measuring gguf-py ...");
    let py = run_python(
        "tools/quant/bench.py",
        &[
            input.display().to_string(),
            format!("{}", a.min_secs.max(0.5)),
        ],
    )?;
    let py: serde_json::Value = serde_json::from_str(py.trim()).context("bench.py output")?;

    let mut q8 = vec![
        BlockQ8_0 {
            d: f16::ZERO,
            qs: [0; QK]
        };
        n / QK
    ];
    let mut q4 = vec![
        BlockQ4_0 {
            d: f16::ZERO,
            qs: [0; QK / 2]
        };
        n / QK
    ];
    let mut h = vec![0u16; n];
    let mut y = vec![0.0f32; n];
    dflash_quant::quantize_q8_0_into(&x, &mut q8)?;
    dflash_quant::quantize_q4_0_into(&x, &mut q4)?;

    let mut rows: Vec<(String, String, Vec<f64>, f64)> = vec![];
    for fmt in ["q8_0", "q4_0", "bf16", "f16"] {
        for op in ["encode", "decode"] {
            let mut ours = vec![];
            for &t in &threads {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
                let mut err = Ok(());
                let secs = pool.install(|| {
                    median_secs(a.min_secs, || {
                        let r = match (fmt, op) {
                            ("q8_0", "encode") => dflash_quant::quantize_q8_0_into(&x, &mut q8),
                            ("q8_0", _) => dflash_quant::try_dequantize_q8_0(&q8, &mut y),
                            ("q4_0", "encode") => dflash_quant::quantize_q4_0_into(&x, &mut q4),
                            ("q4_0", _) => dflash_quant::try_dequantize_q4_0(&q4, &mut y),
                            ("bf16", "encode") => dflash_quant::encode_bf16_into(&x, &mut h),
                            ("bf16", _) => dflash_quant::try_decode_bf16(&h, &mut y),
                            ("f16", "encode") => dflash_quant::encode_f16_into(&x, &mut h),
                            _ => dflash_quant::try_decode_f16(&h, &mut y),
                        };
                        if r.is_err() {
                            err = r;
                        }
                    })
                });
                err?;
                ours.push(gb / secs);
            }
            let key = if op == "encode" {
                "encode_s"
            } else {
                "decode_s"
            };
            let py_s = py[fmt][key].as_f64().context("bench.py output")?;
            rows.push((fmt.to_string(), op.to_string(), ours, gb / py_s));
        }
    }

    let heads: Vec<String> = threads.iter().map(|t| format!("ours {t}T")).collect();
    println!(
        "\n{:<6} {:<7} {} {:>10} {:>12}",
        "format",
        "op",
        heads
            .iter()
            .map(|h| format!("{h:>9}"))
            .collect::<Vec<_>>()
            .join(" "),
        "gguf-py",
        "1T / gguf-py"
    );
    for (fmt, op, ours, pyg) in &rows {
        println!(
            "{fmt:<6} {op:<7} {} {:>10.3} {:>11.1}x",
            ours.iter()
                .map(|g| format!("{g:>9.2}"))
                .collect::<Vec<_>>()
                .join(" "),
            pyg,
            ours[0] / pyg
        );
    }
    println!(
        "\ngguf {} / numpy {} (single thread); ours: dflash-quant, SIMD kernels {}, rayon pools of {:?} threads",
        py["gguf"].as_str().unwrap_or("?"),
        py["numpy"].as_str().unwrap_or("?"),
        if dflash_quant::portable::simd_active() { "on (AVX2+F16C)" } else { "off (portable)" },
        threads
    );
    Ok(())
}

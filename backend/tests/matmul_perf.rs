//! Timing of the CPU matmul for 1 row vs 16 rows (the decode vs verify cost that decides
//! whether speculative decoding pays on the CPU). Not a pass/fail test: run with
//! `cargo test --release -p dflash-backend --test matmul_perf -- --ignored --nocapture`.

use std::time::Instant;

use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, WeightFormat};

fn time_per_call(
    be: &Cpu,
    x: &Vec<f32>,
    rows: usize,
    w: &dflash_backend::Weight<Cpu>,
    out: &mut Vec<f32>,
) -> f64 {
    // The machine is shared: time single calls and keep the fastest tenth's median, which
    // drops the calls interrupted by other processes (each call is far shorter than a slice).
    for _ in 0..50 {
        be.matmul(x, rows, w, out).unwrap();
    }
    let mut times: Vec<f64> = (0..600)
        .map(|_| {
            let t0 = Instant::now();
            be.matmul(x, rows, w, out).unwrap();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[times.len() / 20]
}

/// CPU time of the calling thread in ns (Linux `/proc/thread-self/schedstat`).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|t| t.parse().ok()))
        .unwrap_or(0)
}

fn env_list<T: std::str::FromStr>(name: &str, default: Vec<T>) -> Vec<T> {
    match std::env::var(name) {
        Ok(v) => v.split(',').filter_map(|p| p.trim().parse().ok()).collect(),
        Err(_) => default,
    }
}

/// Env knobs: MM_SHAPES="1024x512,512x512" (out x in), MM_THREADS="1,2", MM_FORMATS="f32,q8",
/// MM_ROWS="5,7,12" (extra widths timed).
#[test]
#[ignore = "timing report, run by hand"]
fn matmul_1_vs_16_rows() {
    let shapes: Vec<(usize, usize)> = env_list::<String>(
        "MM_SHAPES",
        vec![
            "1024x512".into(),
            "512x512".into(),
            "2048x1024".into(),
            "4096x1024".into(),
        ],
    )
    .iter()
    .filter_map(|s| {
        s.split_once('x')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
    })
    .collect();
    let formats: Vec<WeightFormat> = env_list::<String>(
        "MM_FORMATS",
        vec!["f32".into(), "bf16".into(), "q8".into(), "q4".into()],
    )
    .iter()
    .map(|f| match f.as_str() {
        "bf16" => WeightFormat::Bf16,
        "f16" => WeightFormat::F16,
        "q8" => WeightFormat::Q8_0,
        "q4" => WeightFormat::Q4_0,
        _ => WeightFormat::F32,
    })
    .collect();
    for threads in env_list("MM_THREADS", vec![1usize, 2]) {
        let be = Cpu::with_threads(threads).unwrap();
        for &(n, k) in &shapes {
            let vals: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            for &fmt in &formats {
                let w = be
                    .upload_weight(&HostWeight::from_f32("w", n, k, &vals, fmt).unwrap())
                    .unwrap();
                let x: Vec<f32> = (0..16 * k)
                    .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                    .collect();
                let mut out = vec![0.0; 16 * n];
                let t1 = time_per_call(&be, &x, 1, &w, &mut out);
                let t16 = time_per_call(&be, &x, 16, &w, &mut out);
                println!(
                    "threads {threads} [{n} x {k}] {fmt:?}: 1 row {:8.1} us, 16 rows {:8.1} us, ratio {:.2}x ({:.1} GFLOP/s at 16 rows, isa {:?})",
                    t1 * 1e6,
                    t16 * 1e6,
                    t16 / t1,
                    2.0 * 16.0 * (n * k) as f64 / t16 / 1e9,
                    be.isa()
                );
                for rows in env_list::<usize>("MM_ROWS", vec![]) {
                    let rows = rows.clamp(1, 16);
                    let t = time_per_call(&be, &x, rows, &w, &mut out);
                    println!(
                        "    {rows:2} rows {:8.1} us ({:.1} GFLOP/s)",
                        t * 1e6,
                        2.0 * (rows * n * k) as f64 / t / 1e9
                    );
                }
            }
        }
    }
}

/// Env knobs: ATT_CTX="300,1000".
#[test]
#[ignore = "timing report, run by hand"]
fn attention_1_vs_16_queries() {
    use dflash_backend::AttnParams;
    // One thread: ops run on the calling thread, whose CPU time /proc reports (robust to a
    // busy machine, unlike wall time).
    let be = Cpu::with_threads(1).unwrap();
    let (nh, nkv, hd) = (8usize, 4usize, 64usize);
    for ctx in env_list("ATT_CTX", vec![300usize, 1000]) {
        let total = ctx + 16;
        let k: Vec<f32> = (0..total * nkv * hd)
            .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
            .collect();
        let v = k.clone();
        let q: Vec<f32> = (0..16 * nh * hd)
            .map(|i| ((i * 17) % 89) as f32 / 89.0 - 0.5)
            .collect();
        let mut out = vec![0.0; 16 * nh * hd];
        let mut time = |n_q: usize| {
            let p = AttnParams {
                n_q,
                n_kv: ctx + n_q,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                q_pos0: ctx,
                kv_pos0: 0,
                causal: true,
                window: None,
                scale: 0.125,
            };
            for _ in 0..20 {
                be.attention(&q, &k, &v, &p, &mut out).unwrap();
            }
            let n = 200;
            let c0 = thread_cpu_ns();
            for _ in 0..n {
                be.attention(&q, &k, &v, &p, &mut out).unwrap();
            }
            (thread_cpu_ns() - c0) as f64 * 1e-9 / n as f64
        };
        let t1 = time(1);
        let t16 = time(16);
        println!("attention (thread CPU time) ctx {ctx} heads {nh}/{nkv} hd {hd}: 1 query {:.1} us, 16 queries {:.1} us, ratio {:.2}x", t1 * 1e6, t16 * 1e6, t16 / t1);
    }
}

/// A Qwen3-style decoder layer (hidden 256, 4 / 2 heads of 64, intermediate 768, f32) over a
/// cache of `ctx` positions: 1 row (decode) vs 16 rows (verify), thread CPU time, one thread.
/// Env knobs: LAYER_CTX="300".
#[test]
#[ignore = "timing report, run by hand"]
fn layer_1_vs_16_rows() {
    use dflash_backend::{AttnParams, RopeSpec};
    let be = Cpu::with_threads(1).unwrap();
    let (d, nh, nkv, hd, inter) = (256usize, 4usize, 2usize, 64usize, 768usize);
    let mk = |rows: usize, cols: usize, seed: usize| {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (((i + seed) * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        be.upload_weight(&HostWeight::from_f32("w", rows, cols, &v, WeightFormat::F32).unwrap())
            .unwrap()
    };
    let (wq, wk, wv, wo) = (
        mk(nh * hd, d, 1),
        mk(nkv * hd, d, 2),
        mk(nkv * hd, d, 3),
        mk(d, nh * hd, 4),
    );
    let (wg, wu, wd) = (mk(inter, d, 5), mk(inter, d, 6), mk(d, inter, 7));
    let norm = vec![1.0f32; d];
    let hnorm = vec![1.0f32; hd];
    let spec = RopeSpec {
        inv_freq: (0..hd / 2)
            .map(|i| 1e6f32.powf(-(2.0 * i as f32) / hd as f32))
            .collect(),
        attention_scaling: 1.0,
    };
    for ctx in env_list("LAYER_CTX", vec![300usize]) {
        let cap = ctx + 16;
        let kc: Vec<f32> = (0..cap * nkv * hd)
            .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
            .collect();
        let vc = kc.clone();
        let run = |rows: usize| {
            let x: Vec<f32> = (0..rows * d)
                .map(|i| ((i * 13) % 71) as f32 / 71.0 - 0.5)
                .collect();
            let mut kc = kc.clone();
            let mut vc = vc.clone();
            let mut h = vec![0.0; rows * d];
            let mut q = vec![0.0; rows * nh * hd];
            let mut qn = q.clone();
            let mut k = vec![0.0; rows * nkv * hd];
            let mut kn = k.clone();
            let mut v = k.clone();
            let mut att = q.clone();
            let mut o = h.clone();
            let mut g = vec![0.0; rows * inter];
            let mut u = g.clone();
            let mut a = g.clone();
            let mut step = || {
                be.rms_norm(&x, &norm, d, 1e-6, &mut h).unwrap();
                be.matmul(&h, rows, &wq, &mut q).unwrap();
                be.matmul(&h, rows, &wk, &mut k).unwrap();
                be.matmul(&h, rows, &wv, &mut v).unwrap();
                be.rms_norm(&q, &hnorm, hd, 1e-6, &mut qn).unwrap();
                be.rms_norm(&k, &hnorm, hd, 1e-6, &mut kn).unwrap();
                be.rope(&mut qn, rows, nh, hd, ctx, &spec).unwrap();
                be.rope(&mut kn, rows, nkv, hd, ctx, &spec).unwrap();
                be.copy(&kn, 0, &mut kc, ctx * nkv * hd, rows * nkv * hd)
                    .unwrap();
                be.copy(&v, 0, &mut vc, ctx * nkv * hd, rows * nkv * hd)
                    .unwrap();
                let p = AttnParams {
                    n_q: rows,
                    n_kv: ctx + rows,
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    q_pos0: ctx,
                    kv_pos0: 0,
                    causal: true,
                    window: None,
                    scale: 0.125,
                };
                be.attention(&qn, &kc, &vc, &p, &mut att).unwrap();
                be.matmul(&att, rows, &wo, &mut o).unwrap();
                be.add_assign(&mut o, 0, &x, rows * d).unwrap();
                be.rms_norm(&o, &norm, d, 1e-6, &mut h).unwrap();
                be.matmul(&h, rows, &wg, &mut g).unwrap();
                be.matmul(&h, rows, &wu, &mut u).unwrap();
                be.silu_mul(&g, &u, &mut a).unwrap();
                be.matmul(&a, rows, &wd, &mut h).unwrap();
            };
            for _ in 0..20 {
                step();
            }
            let n = 200;
            let c0 = thread_cpu_ns();
            for _ in 0..n {
                step();
            }
            (thread_cpu_ns() - c0) as f64 * 1e-9 / n as f64
        };
        let t1 = run(1);
        let t16 = run(16);
        println!(
            "layer (thread CPU time) ctx {ctx}: 1 row {:.1} us, 16 rows {:.1} us, ratio {:.2}x",
            t1 * 1e6,
            t16 * 1e6,
            t16 / t1
        );
    }
}

/// G MAC/s of Q8_0A8 (integer dot, activations quantized per call) vs bf16 / f32 / q8_0 at
/// the drafter's shapes (out x in) and widths. Env knobs: A8_SHAPES, A8_ROWS, MM_THREADS.
#[test]
#[ignore = "timing report, run by hand"]
fn q8_0a8_vs_float_gmacs() {
    let shapes: Vec<(usize, usize)> = env_list::<String>(
        "A8_SHAPES",
        vec![
            "256x256".into(),
            "768x256".into(),
            "256x768".into(),
            "8192x256".into(),
        ],
    )
    .iter()
    .filter_map(|s| {
        s.split_once('x')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
    })
    .collect();
    let widths = env_list::<usize>("A8_ROWS", vec![1, 4, 8, 16]);
    let formats = [
        WeightFormat::F32,
        WeightFormat::Bf16,
        WeightFormat::Q8_0,
        WeightFormat::Q8_0A8,
    ];
    for threads in env_list("MM_THREADS", vec![1usize]) {
        let be = Cpu::with_threads(threads).unwrap();
        println!(
            "threads {threads}, isa {:?}, VNNI {}",
            be.isa(),
            dflash_backend::cpu::vnni_supported()
        );
        for &(n, k) in &shapes {
            let vals: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            let x: Vec<f32> = (0..16 * k)
                .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                .collect();
            let mut out = vec![0.0; 16 * n];
            let mut line = format!("[{n:5} x {k:4}]");
            for &fmt in &formats {
                let w = be
                    .upload_weight(&HostWeight::from_f32("w", n, k, &vals, fmt).unwrap())
                    .unwrap();
                line += &format!(" {fmt:?}:");
                for &rows in &widths {
                    let rows = rows.clamp(1, 16);
                    let t = time_per_call(&be, &x, rows, &w, &mut out);
                    line += &format!(" {:6.1}", (rows * n * k) as f64 / t / 1e9);
                }
            }
            println!("{line}   (G MAC/s at rows {widths:?})");
        }
    }
}

/// `attention_fast_kv16` (f16 cache) against `attention` (f32 cache) over the same values,
/// us per call (wall time: the 5th percentile of single calls, the two ops interleaved so a
/// busy spell of the shared machine hits both). Env knobs: KV16_SHAPES="4/2/64,8/2/64,32/8/128"
/// (heads / kv heads / head_dim), KV16_CTX="512,4096", KV16_NQ="1,16", KV16_THREADS="1,2".
#[test]
#[ignore = "timing report, run by hand"]
fn attention_kv16_vs_f32() {
    use dflash_backend::AttnParams;
    let shapes: Vec<(usize, usize, usize)> = env_list::<String>(
        "KV16_SHAPES",
        vec!["4/2/64".into(), "8/2/64".into(), "32/8/128".into()],
    )
    .iter()
    .filter_map(|s| {
        let v: Vec<usize> = s.split('/').filter_map(|p| p.parse().ok()).collect();
        (v.len() == 3).then(|| (v[0], v[1], v[2]))
    })
    .collect();
    for threads in env_list("KV16_THREADS", vec![1usize, 2]) {
        let be = Cpu::with_threads(threads).unwrap();
        for &(nh, nkv, hd) in &shapes {
            for ctx in env_list("KV16_CTX", vec![512usize, 4096]) {
                let cap = ctx + 16;
                let n = cap * nkv * hd;
                let k: Vec<f32> = (0..n)
                    .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
                    .collect();
                let v: Vec<f32> = (0..n)
                    .map(|i| ((i * 37) % 89) as f32 / 89.0 - 0.5)
                    .collect();
                let (mut k16, mut v16) = (vec![0.0f32; n / 2], vec![0.0f32; n / 2]);
                be.f16_pack(&k, &mut k16, 0, n).unwrap();
                be.f16_pack(&v, &mut v16, 0, n).unwrap();
                // the f32 cache holds the f16-rounded values: both ops give the same bits
                let (mut kr, mut vr) = (vec![0.0f32; n], vec![0.0f32; n]);
                be.f16_unpack(&k16, 0, n, &mut kr).unwrap();
                be.f16_unpack(&v16, 0, n, &mut vr).unwrap();
                let q: Vec<f32> = (0..16 * nh * hd)
                    .map(|i| ((i * 17) % 89) as f32 / 89.0 - 0.5)
                    .collect();
                for n_q in env_list("KV16_NQ", vec![1usize, 16]) {
                    let p = AttnParams {
                        n_q,
                        n_kv: ctx + n_q,
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        q_pos0: ctx,
                        kv_pos0: 0,
                        causal: true,
                        window: None,
                        scale: 1.0 / (hd as f32).sqrt(),
                    };
                    let (mut o32, mut o16) = (vec![0.0; n_q * nh * hd], vec![0.0; n_q * nh * hd]);
                    let mut f32_call = || be.attention(&q, &kr, &vr, &p, &mut o32).unwrap();
                    let mut f16_call = || {
                        be.attention_fast_kv16(&q, &k16, &v16, &p, &mut o16)
                            .unwrap()
                    };
                    let t0 = Instant::now();
                    f32_call();
                    f16_call();
                    let est = t0.elapsed().as_secs_f64().max(1e-6);
                    let reps = ((0.8 / est) as usize).clamp(10, 400);
                    let (mut t32, mut t16) = (Vec::new(), Vec::new());
                    for _ in 0..reps {
                        let t = Instant::now();
                        f32_call();
                        t32.push(t.elapsed().as_secs_f64());
                        let t = Instant::now();
                        f16_call();
                        t16.push(t.elapsed().as_secs_f64());
                    }
                    assert_eq!(
                        o32.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        o16.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    );
                    let pct = |t: &mut Vec<f64>| {
                        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
                        t[t.len() / 20] * 1e6
                    };
                    let (a, b) = (pct(&mut t32), pct(&mut t16));
                    println!(
                        "threads {threads} heads {nh}/{nkv} hd {hd} ctx {ctx} n_q {n_q:2}: f32 {a:9.1} us, f16 {b:9.1} us, f16/f32 {:.2} ({reps} calls each, isa {:?})",
                        b / a,
                        be.isa()
                    );
                }
            }
        }
    }
}

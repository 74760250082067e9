//! Every op of the CUDA backend against the CPU reference backend, on fresh random inputs
//! each run (seed printed), with outputs poisoned (NaN) before the launch.
//!
//! Tolerances (max |gpu - cpu| / max |cpu| over the output):
//! * gathers, argmax, copies: exact (the same arithmetic, or none);
//! * elementwise, norms, RoPE, gates, conv: 1e-5 (f32; libm vs CUDA transcendental ulps);
//! * f32 / f16 matmul (SIMT, f32 FMA), attention: 2e-5 (different summation order);
//! * bf16 / q8_0 / q4_0 matmul (tensor cores, x split into bf16 hi + lo, ~16 significant
//!   bits of x, f32 accumulation): 1e-4; cuBLAS prefill path: 1e-4;
//! * gated delta rule: 1e-4 (a recurrence over t steps).
//!
//! Plus per-row determinism on the GPU itself, bit for bit.

mod common;

use common::{gpu, poisoned, private_gpu, rand_vec, report, rng};
use dflash_backend::cpu::Cpu;
use dflash_backend::{
    AttnParams, Backend, BackendError, DeltaParams, HostWeight, KvCacheRows, KvStorage, QkNormRope,
    RopeSpec, Weight, WeightFormat,
};
use dflash_cuda_kernels::{AttnFa, AttnKernel, DELTA_CHUNK_MIN};
use rand::Rng;

const FORMATS: [WeightFormat; 5] = [
    WeightFormat::F32,
    WeightFormat::Bf16,
    WeightFormat::F16,
    WeightFormat::Q8_0,
    WeightFormat::Q4_0,
];

/// Random `fmt` matrices of `ns` rows by `k` columns, uploaded to the GPU and to the CPU.
fn weights_on_both(
    g: &dflash_cuda_kernels::Cuda,
    cpu: &Cpu,
    r: &mut rand::rngs::StdRng,
    ns: &[usize],
    k: usize,
    fmt: WeightFormat,
) -> (Vec<Weight<dflash_cuda_kernels::Cuda>>, Vec<Weight<Cpu>>) {
    let hws: Vec<_> = ns
        .iter()
        .map(|&n| HostWeight::from_f32("w", n, k, &rand_vec(r, n * k, 1.0), fmt).expect("encode"))
        .collect();
    let wgs = hws
        .iter()
        .map(|hw| g.upload_weight(hw).expect("w"))
        .collect();
    let wcs = hws
        .iter()
        .map(|hw| cpu.upload_weight(hw).expect("w"))
        .collect();
    (wgs, wcs)
}

fn matmul_tol(f: WeightFormat) -> f32 {
    match f {
        WeightFormat::F32 | WeightFormat::F16 => 2e-5,
        _ => 1e-4,
    }
}

#[test]
fn matmul_all_formats_and_row_counts() {
    let Some(g) = gpu("matmul_all_formats_and_row_counts") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("matmul_all_formats_and_row_counts");
    // (N, K): split-k on and off, ragged N, K not a multiple of 32 (SIMT fallback), long K.
    let shapes = [
        (40000usize, 96usize), // tall: the 64-row-tile kernels of vocabulary heads
        (4096, 4096),
        (1024, 4096),
        (300, 96),
        (77, 50),
        (512, 12288),
        (20000, 256),
    ];
    for &(n, k) in &shapes {
        let wv = rand_vec(&mut r, n * k, 1.0);
        for fmt in FORMATS {
            if matches!(fmt, WeightFormat::Q8_0 | WeightFormat::Q4_0) && k % 32 != 0 {
                continue;
            }
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let wc = cpu.upload_weight(&hw).expect("cpu weight");
            let wg = g.upload_weight(&hw).expect("gpu weight");
            for rows in [1usize, 3, 8, 9, 16, 40] {
                if rows == 40 && n * k > 4096 * 4096 {
                    continue;
                }
                let xv = rand_vec(&mut r, rows * k, 2.0);
                let mut oc = vec![0.0f32; rows * n];
                cpu.matmul(&xv, rows, &wc, &mut oc).expect("cpu matmul");
                let xg = g.upload(&xv).expect("upload");
                let mut og = poisoned(g, rows * n);
                g.matmul(&xg, rows, &wg, &mut og).expect("gpu matmul");
                let got = g.download(&og).expect("download");
                report(
                    &format!("matmul {fmt:?} n={n} k={k} rows={rows}"),
                    &got,
                    &oc,
                    matmul_tol(fmt),
                );
            }
        }
    }
}

/// bf16 matrices are stored in the skinny kernels' fragment order; a prefill (more than 16
/// rows, cuBLAS) unpacks them in row blocks of at most 16M values: a matrix of several blocks
/// (ragged N) against the CPU.
#[test]
fn bf16_prefill_over_unpacked_row_blocks() {
    let Some(g) = gpu("bf16_prefill_over_unpacked_row_blocks") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("bf16_prefill_over_unpacked_row_blocks");
    let (n, k) = (9000usize, 4096usize);
    let hw = HostWeight::from_f32("w", n, k, &rand_vec(&mut r, n * k, 1.0), WeightFormat::Bf16)
        .expect("encode");
    let (wc, wg) = (
        cpu.upload_weight(&hw).expect("cpu weight"),
        g.upload_weight(&hw).expect("gpu weight"),
    );
    for rows in [17usize, 40] {
        let xv = rand_vec(&mut r, rows * k, 2.0);
        let mut want = vec![0.0f32; rows * n];
        cpu.matmul(&xv, rows, &wc, &mut want).expect("cpu matmul");
        let mut og = poisoned(g, rows * n);
        g.matmul(&g.upload(&xv).expect("x"), rows, &wg, &mut og)
            .expect("gpu matmul");
        report(
            &format!("bf16 prefill n={n} k={k} rows={rows}"),
            &g.download(&og).expect("download"),
            &want,
            matmul_tol(WeightFormat::Bf16),
        );
    }
}

/// The block formats' prefill (from `set_quant_prefill_rows` rows): W dequantized in row
/// blocks and split into bf16 hi + lo, x split too (for Q8_0A8 / Q4_0A8 first quantized as
/// their kernels quantize it), three cuBLAS products; against the CPU's matmul of the same
/// weight (its exact q8_0 / q4_0 dot, or the A8 contract) through `matmul`, `matmul_many` and
/// `matmul_silu_mul`, ragged shapes and several row blocks, and on both sides of a threshold
/// (127 rows through the skinny kernels, 128 through cuBLAS).
#[test]
fn quant_prefill_through_cublas_against_cpu() {
    // A private backend: the knob routes other tests' quantized rows too.
    let Some(g) = private_gpu("quant_prefill_through_cublas_against_cpu") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("quant_prefill_through_cublas_against_cpu");
    let fmts = [
        WeightFormat::Q8_0,
        WeightFormat::Q4_0,
        WeightFormat::Q8_0A8,
        WeightFormat::Q4_0A8,
    ];
    let at = 128;
    for &(n, k, rows_list) in &[
        (9000usize, 4096usize, &[at - 1, at][..]), // 3 row blocks of 4096 rows
        (320, 96, &[17, 40][..]),
        (77, 1024, &[33][..]),
    ] {
        let wv = rand_vec(&mut r, n * k, 1.0);
        let gv = rand_vec(&mut r, n * k, 1.0);
        for fmt in fmts {
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let hw2 = HostWeight::from_f32("w2", n, k, &gv, fmt).expect("encode");
            let (wc, wg) = (
                cpu.upload_weight(&hw).expect("cpu weight"),
                g.upload_weight(&hw).expect("gpu weight"),
            );
            let (wc2, wg2) = (
                cpu.upload_weight(&hw2).expect("cpu weight"),
                g.upload_weight(&hw2).expect("gpu weight"),
            );
            // The small shapes' row counts are below the default: take cuBLAS from 17 rows.
            g.set_quant_prefill_rows(Some(if n == 9000 { at } else { 17 }));
            for &rows in rows_list {
                let xv = rand_vec(&mut r, rows * k, 2.0);
                let xg = g.upload(&xv).expect("x");
                let (mut want, mut want2) = (vec![0.0f32; rows * n], vec![0.0f32; rows * n]);
                cpu.matmul(&xv, rows, &wc, &mut want).expect("cpu matmul");
                cpu.matmul(&xv, rows, &wc2, &mut want2).expect("cpu matmul");
                let what = format!("prefill {fmt:?} n={n} k={k} rows={rows}");
                let mut og = poisoned(g, rows * n);
                g.matmul(&xg, rows, &wg, &mut og).expect("gpu matmul");
                report(&what, &g.download(&og).expect("dl"), &want, 1e-4);
                let (mut o1, mut o2) = (poisoned(g, rows * n), poisoned(g, rows * n));
                g.matmul_many(&xg, rows, &[&wg, &wg2], &mut [&mut o1, &mut o2])
                    .expect("gpu matmul_many");
                report(
                    &format!("{what} many #0"),
                    &g.download(&o1).expect("dl"),
                    &want,
                    1e-4,
                );
                report(
                    &format!("{what} many #1"),
                    &g.download(&o2).expect("dl"),
                    &want2,
                    1e-4,
                );
                if n == 320 {
                    // The SiLU product of (gate, up) = (x W^T, x W2^T) into a k x n weight.
                    let hd = HostWeight::from_f32("wd", k, n, &wv[..n * k], fmt).expect("encode");
                    let (dc, dg) = (
                        cpu.upload_weight(&hd).expect("cpu weight"),
                        g.upload_weight(&hd).expect("gpu weight"),
                    );
                    let mut act = vec![0.0f32; rows * n];
                    cpu.silu_mul(&want, &want2, &mut act).expect("cpu silu_mul");
                    let mut wd = vec![0.0f32; rows * k];
                    cpu.matmul(&act, rows, &dc, &mut wd).expect("cpu matmul");
                    let (gg, gu) = (g.upload(&want).expect("g"), g.upload(&want2).expect("u"));
                    let (mut ga, mut go) = (poisoned(g, rows * n), poisoned(g, rows * k));
                    g.matmul_silu_mul(&gg, &gu, &mut ga, rows, &dg, &mut go)
                        .expect("gpu matmul_silu_mul");
                    report(
                        &format!("{what} silu_mul down"),
                        &g.download(&go).expect("dl"),
                        &wd,
                        1e-4,
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_is_per_row_deterministic() {
    let Some(g) = gpu("matmul_is_per_row_deterministic") else {
        return;
    };
    let mut r = rng("matmul_is_per_row_deterministic");
    for &(n, k) in &[
        (1024usize, 4096usize),
        (4096, 1024),
        (333, 160),
        (64, 40),
        (40000, 64),
    ] {
        let wv = rand_vec(&mut r, n * k, 1.0);
        for fmt in FORMATS {
            if matches!(fmt, WeightFormat::Q8_0 | WeightFormat::Q4_0) && k % 32 != 0 {
                continue;
            }
            let wg = g
                .upload_weight(&HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode"))
                .expect("w");
            let xv = rand_vec(&mut r, 16 * k, 2.0);
            let xg = g.upload(&xv).expect("x");
            let mut all = poisoned(g, 16 * n);
            g.matmul(&xg, 16, &wg, &mut all).expect("16 rows");
            let all = g.download(&all).expect("dl");
            for rows in [1usize, 5, 9] {
                let xs = g.upload(&xv[..rows * k]).expect("x");
                let mut o = poisoned(g, rows * n);
                g.matmul(&xs, rows, &wg, &mut o).expect("few rows");
                let o = g.download(&o).expect("dl");
                for (i, (a, b)) in o.iter().zip(&all[..rows * n]).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{fmt:?} n={n} k={k}: row {} col {} differs between {rows} and 16 rows",
                        i / n,
                        i % n
                    );
                }
            }
            eprintln!("DETERMINISM matmul {fmt:?} n={n} k={k}: rows 1/5/9 bit-identical to the same rows of a 16-row call");
        }
    }
}

#[test]
fn gather_rows_all_formats_exact() {
    let Some(g) = gpu("gather_rows_all_formats_exact") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("gather_rows_all_formats_exact");
    let (n, k) = (1000usize, 256usize);
    let wv = rand_vec(&mut r, n * k, 3.0);
    let ids: Vec<u32> = (0..17).map(|_| r.random_range(0..n as u32)).collect();
    for fmt in FORMATS {
        let hw = HostWeight::from_f32("emb", n, k, &wv, fmt).expect("encode");
        let wc = cpu.upload_weight(&hw).expect("w");
        let wg = g.upload_weight(&hw).expect("w");
        let mut oc = vec![0.0f32; ids.len() * k];
        cpu.gather_rows(&wc, &ids, &mut oc).expect("cpu");
        let mut og = poisoned(g, ids.len() * k);
        g.gather_rows(&wg, &ids, &mut og).expect("gpu");
        report(
            &format!("gather_rows {fmt:?}"),
            &g.download(&og).expect("dl"),
            &oc,
            0.0,
        );
    }
    let wg = g
        .upload_weight(&HostWeight::from_f32("emb", n, k, &wv, WeightFormat::F32).expect("e"))
        .expect("w");
    let mut og = g.zeros(k).expect("z");
    assert!(
        g.gather_rows(&wg, &[n as u32], &mut og).is_err(),
        "an id out of range must be an error"
    );
}

#[test]
fn norms_rope_elementwise() {
    let Some(g) = gpu("norms_rope_elementwise") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("norms_rope_elementwise");
    for &(rows, dim) in &[(16usize, 4096usize), (512, 128), (3, 100)] {
        let x = rand_vec(&mut r, rows * dim, 3.0);
        let z = rand_vec(&mut r, rows * dim, 3.0);
        let w = rand_vec(&mut r, dim, 1.5);
        let (xg, zg, wg) = (
            g.upload(&x).unwrap(),
            g.upload(&z).unwrap(),
            g.upload(&w).unwrap(),
        );
        let mut oc = vec![0.0; rows * dim];
        cpu.rms_norm(&x, &w, dim, 1e-6, &mut oc).unwrap();
        let mut og = poisoned(g, rows * dim);
        g.rms_norm(&xg, &wg, dim, 1e-6, &mut og).unwrap();
        report(
            &format!("rms_norm rows={rows} dim={dim}"),
            &g.download(&og).unwrap(),
            &oc,
            1e-5,
        );
        cpu.rms_norm_gated(&x, &z, &w, dim, 1e-6, &mut oc).unwrap();
        let mut og = poisoned(g, rows * dim);
        g.rms_norm_gated(&xg, &zg, &wg, dim, 1e-6, &mut og).unwrap();
        report(
            &format!("rms_norm_gated rows={rows} dim={dim}"),
            &g.download(&og).unwrap(),
            &oc,
            1e-5,
        );

        let mut oc = vec![0.0; rows * dim];
        cpu.silu_mul(&x, &z, &mut oc).unwrap();
        let mut og = poisoned(g, rows * dim);
        g.silu_mul(&xg, &zg, &mut og).unwrap();
        report(
            &format!("silu_mul n={}", rows * dim),
            &g.download(&og).unwrap(),
            &oc,
            1e-5,
        );

        let mut c = x.clone();
        let mut gg = g.upload(&x).unwrap();
        cpu.scale(&mut c, 0.37).unwrap();
        g.scale(&mut gg, 0.37).unwrap();
        report("scale", &g.download(&gg).unwrap(), &c, 0.0);
        cpu.mul_sigmoid(&mut c, &z).unwrap();
        g.mul_sigmoid(&mut gg, &zg).unwrap();
        report("mul_sigmoid", &g.download(&gg).unwrap(), &c, 1e-5);
        let off = dim / 3;
        let len = rows * dim - off;
        cpu.add_assign(&mut c, off, &z, len).unwrap();
        g.add_assign(&mut gg, off, &zg, len).unwrap();
        report("add_assign (offset)", &g.download(&gg).unwrap(), &c, 1e-5);
    }
    // RoPE: plain, partial rotary, YaRN-like divisors with a post scale, far positions.
    for &(rows, heads, hd, half, pos0, sc) in &[
        (16usize, 32usize, 128usize, 64usize, 8192usize, 1.0f32),
        (7, 8, 128, 32, 3, 1.0),
        (16, 4, 64, 32, 100_000, 1.17),
    ] {
        let inv: Vec<f32> = (0..half)
            .map(|i| {
                1.0 / 1_000_000f32.powf(2.0 * i as f32 / (2 * half) as f32)
                    / if i > half / 2 { 4.0 } else { 1.0 }
            })
            .collect();
        let spec = RopeSpec {
            inv_freq: inv,
            attention_scaling: sc,
        };
        let x = rand_vec(&mut r, rows * heads * hd, 2.0);
        let mut c = x.clone();
        let mut gg = g.upload(&x).unwrap();
        cpu.rope(&mut c, rows, heads, hd, pos0, &spec).unwrap();
        g.rope(&mut gg, rows, heads, hd, pos0, &spec).unwrap();
        report(
            &format!(
                "rope rows={rows} heads={heads} hd={hd} rot={} pos0={pos0}",
                2 * half
            ),
            &g.download(&gg).unwrap(),
            &c,
            1e-5,
        );
    }
    // copy2d / copy
    let src = rand_vec(&mut r, 1000, 1.0);
    let sg = g.upload(&src).unwrap();
    let mut dc = rand_vec(&mut r, 900, 1.0);
    let mut dg = g.upload(&dc).unwrap();
    cpu.copy2d(&src, 7, 50, &mut dc, 3, 60, 12, 40).unwrap();
    g.copy2d(&sg, 7, 50, &mut dg, 3, 60, 12, 40).unwrap();
    report("copy2d", &g.download(&dg).unwrap(), &dc, 0.0);
    cpu.copy(&src, 100, &mut dc, 0, 333).unwrap();
    g.copy(&sg, 100, &mut dg, 0, 333).unwrap();
    report("copy", &g.download(&dg).unwrap(), &dc, 0.0);
}

#[test]
fn argmax_over_a_large_vocabulary() {
    let Some(g) = gpu("argmax_over_a_large_vocabulary") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("argmax_over_a_large_vocabulary");
    let (rows, cols) = (16usize, 151_936usize);
    let mut x = rand_vec(&mut r, rows * cols, 10.0);
    // Ties (first occurrence wins), NaN (never wins), an all-NaN row.
    x[2 * cols + 5] = 50.0;
    x[2 * cols + 150_000] = 50.0;
    x[3 * cols + 7] = f32::NAN;
    x[3 * cols + 9] = 1e30;
    x[3 * cols + 8] = f32::NAN;
    for v in &mut x[4 * cols..5 * cols] {
        *v = f32::NAN;
    }
    x[5 * cols + cols - 1] = f32::INFINITY;
    let xg = g.upload(&x).unwrap();
    for (row0, n) in [(0usize, 16usize), (1, 15), (5, 1)] {
        let c = cpu.argmax_rows(&x, row0, n, cols).unwrap();
        let d = g.argmax_rows(&xg, row0, n, cols).unwrap();
        assert_eq!(c, d, "argmax rows {row0}..{}", row0 + n);
    }
    eprintln!("PARITY argmax_rows 16 x 151936 (ties, NaN, all-NaN row, +inf): identical");
}

fn attn_case(
    g: &dflash_cuda_kernels::Cuda,
    cpu: &Cpu,
    r: &mut rand::rngs::StdRng,
    p: AttnParams,
    cap: usize,
) {
    let q = rand_vec(r, p.n_q * p.n_heads * p.head_dim, 1.5);
    let k = rand_vec(r, cap * p.n_kv_heads * p.head_dim, 1.5);
    let v = rand_vec(r, cap * p.n_kv_heads * p.head_dim, 1.0);
    let (oc, qg, kg, vg) = attn_reference(g, cpu, &q, &k, &v, &p);
    let mut og = poisoned(g, oc.len());
    g.attention(&qg, &kg, &vg, &p, &mut og).unwrap();
    report(
        &format!(
            "attention nq={} nkv={} h={}/{} d={} causal={} win={:?}",
            p.n_q, p.n_kv, p.n_heads, p.n_kv_heads, p.head_dim, p.causal, p.window
        ),
        &g.download(&og).unwrap(),
        &oc,
        2e-5,
    );
}

#[test]
fn attention_against_cpu() {
    let Some(g) = gpu("attention_against_cpu") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("attention_against_cpu");
    let base = AttnParams {
        n_q: 16,
        n_kv: 528,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        q_pos0: 512,
        kv_pos0: 0,
        causal: false,
        window: None,
        scale: 128f32.powf(-0.5),
    };
    attn_case(g, &cpu, &mut r, base, 600);
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            causal: true,
            ..base
        },
        528,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_kv: 8208,
            q_pos0: 8192,
            window: Some(2048),
            ..base
        },
        8208,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_kv: 3000,
            q_pos0: 2990,
            causal: true,
            window: Some(700),
            ..base
        },
        3000,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 1,
            n_kv: 77,
            q_pos0: 76,
            causal: true,
            ..base
        },
        77,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 40,
            n_kv: 300,
            q_pos0: 260,
            causal: true,
            n_heads: 16,
            n_kv_heads: 2,
            head_dim: 64,
            ..base
        },
        300,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 5,
            n_kv: 90,
            q_pos0: 85,
            causal: true,
            n_heads: 4,
            n_kv_heads: 4,
            head_dim: 256,
            ..base
        },
        90,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 9,
            n_kv: 70,
            q_pos0: 61,
            causal: true,
            n_heads: 6,
            n_kv_heads: 3,
            head_dim: 32,
            ..base
        },
        70,
    );
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 9,
            n_kv: 70,
            q_pos0: 61,
            causal: true,
            n_heads: 6,
            n_kv_heads: 3,
            head_dim: 48,
            ..base
        },
        70,
    );
    // A window of 0 is an error on both backends.
    {
        let p = AttnParams {
            n_q: 3,
            n_kv: 40,
            q_pos0: 37,
            causal: true,
            window: Some(0),
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            ..base
        };
        let (q, kv) = (vec![0.5f32; 3 * 2 * 64], vec![0.5f32; 40 * 64]);
        let mut oc = vec![0.0; 3 * 2 * 64];
        assert!(
            cpu.attention(&q, &kv, &kv, &p, &mut oc).is_err(),
            "cpu accepted a window of 0"
        );
        let (qg, kg) = (g.upload(&q).unwrap(), g.upload(&kv).unwrap());
        let mut og = g.zeros(3 * 2 * 64).unwrap();
        assert!(
            g.attention(&qg, &kg, &kg, &p, &mut og).is_err(),
            "cuda accepted a window of 0"
        );
    }
    // A query that sees no key (causal, all keys after it) gets a zero row.
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 3,
            n_kv: 40,
            q_pos0: 0,
            kv_pos0: 10,
            causal: true,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            ..base
        },
        40,
    );
    // kv_pos0 != 0 (a cache holding a window of positions).
    attn_case(
        g,
        &cpu,
        &mut r,
        AttnParams {
            n_q: 16,
            n_kv: 1000,
            q_pos0: 5000,
            kv_pos0: 4016,
            causal: true,
            window: Some(512),
            ..base
        },
        1000,
    );
}

#[test]
fn attention_is_per_row_deterministic() {
    let Some(g) = gpu("attention_is_per_row_deterministic") else {
        return;
    };
    let mut r = rng("attention_is_per_row_deterministic");
    // Causal (the target): decode of query i == row i of a 16-query verify. Non-causal (the
    // drafter's block attention; the automatic split depends on n_kv only: 128 keys up to 1024
    // keys, else 256): a row alone == the same row of the 16-row block.
    for &(ctx, hd, win, causal) in &[
        (8192usize, 128usize, None, true),
        (700, 128, Some(256usize), true),
        (300, 64, None, true),
        (50, 48, None, true),
        (512, 128, None, false),
        (1008, 64, None, false),
        (2000, 128, None, false),
    ] {
        let (h, hkv, nq) = (32usize, 8usize, 16usize);
        let cap = ctx + nq;
        let q = rand_vec(&mut r, nq * h * hd, 1.5);
        let k = g.upload(&rand_vec(&mut r, cap * hkv * hd, 1.5)).unwrap();
        let v = g.upload(&rand_vec(&mut r, cap * hkv * hd, 1.0)).unwrap();
        let p = AttnParams {
            n_q: nq,
            n_kv: cap,
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: hd,
            q_pos0: ctx,
            kv_pos0: 0,
            causal,
            window: win,
            scale: (hd as f32).powf(-0.5),
        };
        let qg = g.upload(&q).unwrap();
        let mut all = poisoned(g, nq * h * hd);
        g.attention(&qg, &k, &v, &p, &mut all).unwrap();
        let all = g.download(&all).unwrap();
        assert_rows_alone_equal(
            g,
            &q,
            &k,
            &v,
            &p,
            &all,
            Op::Exact,
            &format!("ctx {ctx} hd {hd} causal {causal}"),
        );
        eprintln!("DETERMINISM attention ctx={ctx} hd={hd} win={win:?} causal={causal}: queries 0/7/15 alone bit-identical to the 16-query call");
    }
}

#[test]
fn gdn_ops_against_cpu() {
    let Some(g) = gpu("gdn_ops_against_cpu") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("gdn_ops_against_cpu");
    // causal_conv1d with state and stash
    let (t, ch, ker) = (7usize, 300usize, 4usize);
    let x = rand_vec(&mut r, t * ch, 2.0);
    let w = rand_vec(&mut r, ch * ker, 1.0);
    let st = rand_vec(&mut r, (ker - 1) * ch, 2.0);
    let (mut sc, mut oc, mut stc) = (st.clone(), vec![0.0; t * ch], vec![0.0; t * (ker - 1) * ch]);
    cpu.causal_conv1d(&x, t, ch, ker, &w, &mut sc, &mut oc, Some(&mut stc))
        .unwrap();
    let (xg, wg, mut sg) = (
        g.upload(&x).unwrap(),
        g.upload(&w).unwrap(),
        g.upload(&st).unwrap(),
    );
    let (mut og, mut stg) = (poisoned(g, t * ch), poisoned(g, t * (ker - 1) * ch));
    g.causal_conv1d(&xg, t, ch, ker, &wg, &mut sg, &mut og, Some(&mut stg))
        .unwrap();
    report("causal_conv1d out", &g.download(&og).unwrap(), &oc, 1e-5);
    report("causal_conv1d state", &g.download(&sg).unwrap(), &sc, 1e-5);
    report(
        "causal_conv1d stash",
        &g.download(&stg).unwrap(),
        &stc,
        1e-5,
    );
    // gates
    let nh = 16usize;
    let a = rand_vec(&mut r, t * nh, 25.0);
    let b = rand_vec(&mut r, t * nh, 5.0);
    let alog = rand_vec(&mut r, nh, 1.0);
    let dtb = rand_vec(&mut r, nh, 1.0);
    let (mut gc, mut bc) = (vec![0.0; t * nh], vec![0.0; t * nh]);
    cpu.gdn_gates(&a, &b, &alog, &dtb, nh, &mut gc, &mut bc)
        .unwrap();
    let (mut gg, mut bg) = (poisoned(g, t * nh), poisoned(g, t * nh));
    g.gdn_gates(
        &g.upload(&a).unwrap(),
        &g.upload(&b).unwrap(),
        &g.upload(&alog).unwrap(),
        &g.upload(&dtb).unwrap(),
        nh,
        &mut gg,
        &mut bg,
    )
    .unwrap();
    report("gdn_gates g", &g.download(&gg).unwrap(), &gc, 1e-5);
    report("gdn_gates beta", &g.download(&bg).unwrap(), &bc, 1e-5);
    // gated delta rule
    for l2 in [true, false] {
        let p = DeltaParams {
            t: 6,
            n_k_heads: 2,
            n_v_heads: 4,
            dk: 128,
            dv: 128,
            qk_l2norm: l2,
            q_scale: 128f32.powf(-0.5),
        };
        let q = rand_vec(&mut r, p.t * p.n_k_heads * p.dk, 1.0);
        let k = rand_vec(&mut r, p.t * p.n_k_heads * p.dk, if l2 { 1.0 } else { 0.1 });
        let v = rand_vec(&mut r, p.t * p.n_v_heads * p.dv, 1.0);
        let gl: Vec<f32> = rand_vec(&mut r, p.t * p.n_v_heads, 1.0)
            .iter()
            .map(|x| -x.abs())
            .collect();
        let be: Vec<f32> = rand_vec(&mut r, p.t * p.n_v_heads, 1.0)
            .iter()
            .map(|x| x.abs())
            .collect();
        let s0 = rand_vec(&mut r, p.n_v_heads * p.dk * p.dv, 0.5);
        let (mut sc, mut oc, mut stc) = (
            s0.clone(),
            vec![0.0; p.t * p.n_v_heads * p.dv],
            vec![0.0; p.t * p.n_v_heads * p.dk * p.dv],
        );
        cpu.gated_delta_rule(&q, &k, &v, &gl, &be, &p, &mut sc, &mut oc, Some(&mut stc))
            .unwrap();
        let mut sg = g.upload(&s0).unwrap();
        let (mut og, mut stg) = (poisoned(g, oc.len()), poisoned(g, stc.len()));
        let up = |v: &Vec<f32>| g.upload(v).unwrap();
        g.gated_delta_rule(
            &up(&q),
            &up(&k),
            &up(&v),
            &up(&gl),
            &up(&be),
            &p,
            &mut sg,
            &mut og,
            Some(&mut stg),
        )
        .unwrap();
        report(
            &format!("gated_delta_rule out l2norm={l2}"),
            &g.download(&og).unwrap(),
            &oc,
            1e-4,
        );
        report(
            &format!("gated_delta_rule state l2norm={l2}"),
            &g.download(&sg).unwrap(),
            &sc,
            1e-4,
        );
        report(
            &format!("gated_delta_rule stash l2norm={l2}"),
            &g.download(&stg).unwrap(),
            &stc,
            1e-4,
        );
    }
    recurrent_kernels_per_token_and_against_cpu(g, &cpu, &mut r);
}

/// `gated_delta_rule_qkv` (the recurrence from the conv's rows, the gates from `a` / `b`):
/// output, state and stash bit for bit those of the separate ops on the device (q / k / v
/// copied out, `gdn_gates`, `gated_delta_rule`), through the register kernels (dk <= 128 and
/// <= 256, one token and a verify's 16, with and without a stash, l2norm off) and the paths
/// that fall back to the ops (the chunked form, dk > 256); against the CPU; a `qkv` of the
/// wrong length is refused naming it.
#[test]
fn gated_delta_rule_qkv_is_the_separate_ops() {
    // A private backend: the shared one's recurrent kernels are switched by another test.
    let Some(g) = private_gpu("gated_delta_rule_qkv_is_the_separate_ops") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("gated_delta_rule_qkv_is_the_separate_ops");
    let dl = |b: &dflash_cuda_kernels::CudaBuf| g.download(b).unwrap();
    for (t, nk, nv, dk, dv, l2, stash) in [
        (1usize, 2usize, 4usize, 128usize, 128usize, true, true),
        (1, 2, 4, 128, 128, true, false),
        (16, 2, 4, 128, 128, true, true),
        (16, 1, 2, 256, 96, true, true),
        (7, 1, 3, 72, 40, false, false),
        (200, 2, 4, 128, 64, true, false),
        (5, 1, 1, 300, 64, true, true),
    ] {
        let p = DeltaParams {
            t,
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            qk_l2norm: l2,
            q_scale: (dk as f32).powf(-0.5),
        };
        let what =
            format!("gated_delta_rule_qkv t={t} {nk}/{nv} dk={dk} dv={dv} l2={l2} stash={stash}");
        let ch = 2 * nk * dk + nv * dv;
        let mut qkv = rand_vec(&mut r, t * ch, 1.0);
        if !l2 {
            // Unnormalized keys small enough for a stable recurrence.
            for row in qkv.chunks_mut(ch) {
                row[nk * dk..2 * nk * dk].iter_mut().for_each(|x| *x *= 0.1);
            }
        }
        let a = rand_vec(&mut r, t * nv, 4.0);
        let b = rand_vec(&mut r, t * nv, 3.0);
        let a_log = rand_vec(&mut r, nv, 1.0);
        let dt_bias = rand_vec(&mut r, nv, 1.0);
        let s0 = rand_vec(&mut r, nv * dk * dv, 0.5);
        let ss = t * nv * dk * dv;
        let (mut sc, mut oc, mut stc) = (s0.clone(), vec![0.0; t * nv * dv], vec![0.0; ss]);
        cpu.gated_delta_rule_qkv(
            &qkv,
            &a,
            &b,
            &a_log,
            &dt_bias,
            &p,
            &mut sc,
            &mut oc,
            stash.then_some(&mut stc),
        )
        .unwrap();
        let up = |v: &[f32]| g.upload(v).unwrap();
        let (qkvg, ag, bg, alg, dtg) = (up(&qkv), up(&a), up(&b), up(&a_log), up(&dt_bias));
        let mut runs = Vec::new();
        for fused in [true, false] {
            let mut sg = up(&s0);
            let mut og = poisoned(g, oc.len());
            let mut stg = poisoned(g, ss.max(1));
            let st = stash.then_some(&mut stg);
            if fused {
                g.gated_delta_rule_qkv(&qkvg, &ag, &bg, &alg, &dtg, &p, &mut sg, &mut og, st)
            } else {
                dflash_backend::gated_delta_rule_qkv_ops(
                    g, &qkvg, &ag, &bg, &alg, &dtg, &p, &mut sg, &mut og, st,
                )
            }
            .unwrap();
            runs.push((dl(&og), dl(&sg), stash.then(|| dl(&stg))));
        }
        assert_same_bits(&format!("{what} out vs the ops"), &runs[0].0, &runs[1].0);
        assert_same_bits(&format!("{what} state vs the ops"), &runs[0].1, &runs[1].1);
        if let (Some(f), Some(o)) = (&runs[0].2, &runs[1].2) {
            assert_same_bits(&format!("{what} stash vs the ops"), f, o);
            report(&format!("{what} stash"), f, &stc, 1e-4);
        }
        report(&format!("{what} out"), &runs[0].0, &oc, 1e-4);
        report(&format!("{what} state"), &runs[0].1, &sc, 1e-4);
        // A qkv one value short: refused, naming it (the fused path and the ops' alike).
        let short = up(&qkv[..t * ch - 1]);
        let mut sg = up(&s0);
        let mut og = poisoned(g, oc.len());
        match g.gated_delta_rule_qkv(&short, &ag, &bg, &alg, &dtg, &p, &mut sg, &mut og, None) {
            Err(BackendError::Shape { operand, .. }) => assert_eq!(operand, "qkv", "{what}"),
            other => panic!("{what}: a short qkv gave {other:?}"),
        }
    }
    eprintln!("gated_delta_rule_qkv: the bits of the separate ops; matches the CPU");
}

/// The hybrid targets' recurrent ops at more shapes, both kernels of each
/// (`Cuda::set_recurrent_parallel`; this test alone switches it in this binary): against the
/// CPU; a call of `t` tokens equal bit for bit to `t` calls of one token (what the spec
/// stream == plain greedy stream rests on); the chunked convolution equal bit for bit to the
/// sequential one.
fn recurrent_kernels_per_token_and_against_cpu(
    g: &dflash_cuda_kernels::Cuda,
    cpu: &Cpu,
    r: &mut rand::rngs::StdRng,
) {
    let dl = |b: &dflash_cuda_kernels::CudaBuf| g.download(b).unwrap();
    // causal_conv1d: many chunks, kernels 1..=4.
    for (t, ch, ker) in [
        (1000usize, 300usize, 4usize),
        (37, 130, 2),
        (20, 64, 1),
        (3, 96, 4),
    ] {
        let x = rand_vec(r, t * ch, 2.0);
        let w = rand_vec(r, ch * ker, 1.0);
        let st = rand_vec(r, (ker - 1) * ch, 2.0);
        let sl = (ker - 1) * ch;
        let (mut sc, mut oc, mut stc) = (st.clone(), vec![0.0; t * ch], vec![0.0; t * sl]);
        cpu.causal_conv1d(&x, t, ch, ker, &w, &mut sc, &mut oc, Some(&mut stc))
            .unwrap();
        let (xg, wg) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let mut runs = Vec::new();
        for par in [true, false] {
            g.set_recurrent_parallel(par);
            let mut sg = g.upload(&st).unwrap();
            let (mut og, mut stg) = (poisoned(g, t * ch), poisoned(g, t * sl));
            g.causal_conv1d(&xg, t, ch, ker, &wg, &mut sg, &mut og, Some(&mut stg))
                .unwrap();
            let what = format!("causal_conv1d t={t} ch={ch} k={ker} parallel={par}");
            report(&format!("{what} out"), &dl(&og), &oc, 1e-5);
            report(&format!("{what} state"), &dl(&sg), &sc, 1e-5);
            report(&format!("{what} stash"), &dl(&stg), &stc, 1e-5);
            runs.push((dl(&og), dl(&sg), dl(&stg)));
        }
        g.set_recurrent_parallel(true);
        let what = format!("causal_conv1d t={t} ch={ch} k={ker}");
        assert_same_bits(
            &format!("{what} out, chunked vs sequential"),
            &runs[0].0,
            &runs[1].0,
        );
        assert_same_bits(
            &format!("{what} state, chunked vs sequential"),
            &runs[0].1,
            &runs[1].1,
        );
        assert_same_bits(
            &format!("{what} stash, chunked vs sequential"),
            &runs[0].2,
            &runs[1].2,
        );
        // One token per call.
        let mut sg = g.upload(&st).unwrap();
        let mut o1 = Vec::with_capacity(t * ch);
        for i in 0..t.min(40) {
            let xi = g.upload(&x[i * ch..(i + 1) * ch]).unwrap();
            let mut oi = poisoned(g, ch);
            g.causal_conv1d(&xi, 1, ch, ker, &wg, &mut sg, &mut oi, None)
                .unwrap();
            o1.extend(dl(&oi));
        }
        let n = o1.len();
        assert_same_bits(
            &format!("{what} out, one token per call"),
            &o1,
            &runs[0].0[..n],
        );
    }
    // gated_delta_rule: the register kernels (dk <= 128, <= 256; dv under and over 32 columns,
    // not a multiple of 32) and the shared-memory kernel (dk > 256, and the knob off).
    for (t, nk, nv, dk, dv) in [
        (40usize, 2usize, 4usize, 128usize, 128usize),
        (20, 1, 3, 72, 40),
        (12, 1, 2, 256, 96),
        (9, 2, 2, 136, 20),
        (5, 1, 1, 300, 64),
    ] {
        for l2 in [true, false] {
            let p = DeltaParams {
                t,
                n_k_heads: nk,
                n_v_heads: nv,
                dk,
                dv,
                qk_l2norm: l2,
                q_scale: (dk as f32).powf(-0.5),
            };
            let q = rand_vec(r, t * nk * dk, 1.0);
            let k = rand_vec(r, t * nk * dk, if l2 { 1.0 } else { 0.1 });
            let v = rand_vec(r, t * nv * dv, 1.0);
            let gl: Vec<f32> = rand_vec(r, t * nv, 1.0).iter().map(|x| -x.abs()).collect();
            let be: Vec<f32> = rand_vec(r, t * nv, 1.0).iter().map(|x| x.abs()).collect();
            let s0 = rand_vec(r, nv * dk * dv, 0.5);
            let ss = dk * dv;
            let (mut sc, mut oc, mut stc) =
                (s0.clone(), vec![0.0; t * nv * dv], vec![0.0; t * nv * ss]);
            cpu.gated_delta_rule(&q, &k, &v, &gl, &be, &p, &mut sc, &mut oc, Some(&mut stc))
                .unwrap();
            let up = |v: &Vec<f32>| g.upload(v).unwrap();
            let (qg, kg, vg, gg, bg) = (up(&q), up(&k), up(&v), up(&gl), up(&be));
            let mut batched = None;
            for par in [true, false] {
                g.set_recurrent_parallel(par);
                let what = format!(
                    "gated_delta_rule t={t} {nk}/{nv} dk={dk} dv={dv} l2={l2} parallel={par}"
                );
                let mut sg = up(&s0);
                let (mut og, mut stg) = (poisoned(g, oc.len()), poisoned(g, stc.len()));
                g.gated_delta_rule(
                    &qg,
                    &kg,
                    &vg,
                    &gg,
                    &bg,
                    &p,
                    &mut sg,
                    &mut og,
                    Some(&mut stg),
                )
                .unwrap();
                report(&format!("{what} out"), &dl(&og), &oc, 1e-4);
                report(&format!("{what} state"), &dl(&sg), &sc, 1e-4);
                report(&format!("{what} stash"), &dl(&stg), &stc, 1e-4);
                // One token per call from the same state: the same bits as the batched call.
                let mut s1 = up(&s0);
                let mut o1 = Vec::with_capacity(t * nv * dv);
                let p1 = DeltaParams { t: 1, ..p };
                for i in 0..t {
                    let part = |v: &Vec<f32>, w: usize| up(&v[i * w..(i + 1) * w].to_vec());
                    let mut oi = poisoned(g, nv * dv);
                    g.gated_delta_rule(
                        &part(&q, nk * dk),
                        &part(&k, nk * dk),
                        &part(&v, nv * dv),
                        &part(&gl, nv),
                        &part(&be, nv),
                        &p1,
                        &mut s1,
                        &mut oi,
                        None,
                    )
                    .unwrap();
                    o1.extend(dl(&oi));
                }
                assert_same_bits(&format!("{what} out, one token per call"), &o1, &dl(&og));
                assert_same_bits(
                    &format!("{what} state, one token per call"),
                    &dl(&s1),
                    &dl(&sg),
                );
                let last = &dl(&stg)[(t - 1) * nv * ss..];
                assert_same_bits(&format!("{what} last stash row vs state"), last, &dl(&sg));
                if par {
                    batched = Some(dl(&og));
                } else if let Some(b) = &batched {
                    report(
                        &format!("{what} out, register vs shared-memory kernel"),
                        b,
                        &dl(&og),
                        1e-4,
                    );
                }
            }
            g.set_recurrent_parallel(true);
        }
    }
    // gated_delta_rule in chunks of 64 (by default calls of DELTA_CHUNK_MIN tokens or more, no
    // stash, l2norm on, dk <= 128) against the CPU's token-by-token recurrence: a whole chunk, a
    // ragged last chunk, dk under 128 with dv not a multiple of 32, gates strong enough that a
    // chunk's cumulative decay underflows, and the Qwen3.6-27B shape over enough tokens for
    // two spans of the scratch. The same call through the recurrent kernels (the knob) agrees
    // with the CPU too, so the comparison has a second witness on the device.
    for (t, nk, nv, dk, dv, gscale) in [
        (64usize, 1usize, 2usize, 128usize, 128usize, 1.0f32),
        (100, 2, 4, 128, 64, 1.0),
        (200, 1, 3, 72, 40, 1.0),
        (300, 2, 2, 128, 96, 30.0),
        (2200, 16, 48, 128, 128, 0.3),
    ] {
        let p = DeltaParams {
            t,
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            qk_l2norm: true,
            q_scale: (dk as f32).powf(-0.5),
        };
        let q = rand_vec(r, t * nk * dk, 1.0);
        let k = rand_vec(r, t * nk * dk, 1.0);
        let v = rand_vec(r, t * nv * dv, 1.0);
        let gl: Vec<f32> = rand_vec(r, t * nv, gscale)
            .iter()
            .map(|x| -x.abs())
            .collect();
        let be: Vec<f32> = rand_vec(r, t * nv, 1.0)
            .iter()
            .map(|x| x.abs().min(1.0))
            .collect();
        let s0 = rand_vec(r, nv * dk * dv, 0.5);
        let (mut sc, mut oc) = (s0.clone(), vec![0.0; t * nv * dv]);
        cpu.gated_delta_rule(&q, &k, &v, &gl, &be, &p, &mut sc, &mut oc, None)
            .unwrap();
        let up = |v: &Vec<f32>| g.upload(v).unwrap();
        let (qg, kg, vg, gg, bg) = (up(&q), up(&k), up(&v), up(&gl), up(&be));
        // Chunked at any length (the knob at 1), then the recurrent kernels (never chunked).
        for (name, min) in [("chunked", 1), ("recurrent", usize::MAX)] {
            g.set_delta_chunk_min(min);
            let what =
                format!("gated_delta_rule {name} t={t} {nk}/{nv} dk={dk} dv={dv} g*{gscale}");
            let mut sg = up(&s0);
            let mut og = poisoned(g, oc.len());
            g.gated_delta_rule(&qg, &kg, &vg, &gg, &bg, &p, &mut sg, &mut og, None)
                .unwrap();
            report(&format!("{what} out"), &dl(&og), &oc, 1e-4);
            report(&format!("{what} state"), &dl(&sg), &sc, 1e-4);
        }
        g.set_delta_chunk_min(DELTA_CHUNK_MIN);
    }
}

#[test]
fn markov_chain_on_device() {
    let Some(g) = gpu("markov_chain_on_device") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("markov_chain_on_device");
    // Ranks 256 and 64: the tensor-core step for bf16 / q8_0 / q4_0, the lane-contiguous
    // kernel for f32 / f16, the tile kernel for Q8_0A8; rank 100 (not a multiple of 8, f32 /
    // bf16 / f16 only): the scalar-load kernel. The step spreads the vocabulary over one wave
    // of blocks: 20011 rows give blocks of several tiles and a ragged last block; the 8B
    // vocabulary (bf16 / q8_0 / q4_0 only) the shipped shape.
    for (vocab, rank, n) in [
        (5000usize, 256usize, 15usize),
        (3000, 100, 6),
        (20011, 64, 4),
        (151936, 256, 3),
    ] {
        let w1v = rand_vec(&mut r, vocab * rank, 1.0);
        let w2v = rand_vec(&mut r, vocab * rank, 0.2);
        // Q8_0A8 too: its W2 runs its own kernel (one warp per 16-row tile of the fragment
        // layout).
        for fmt in FORMATS.into_iter().chain([WeightFormat::Q8_0A8]) {
            if rank % 32 != 0
                && !matches!(
                    fmt,
                    WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::F16
                )
            {
                continue;
            }
            if vocab > 100_000
                && !matches!(
                    fmt,
                    WeightFormat::Bf16 | WeightFormat::Q8_0 | WeightFormat::Q4_0
                )
            {
                continue;
            }
            let h1 = HostWeight::from_f32("markov_w1", vocab, rank, &w1v, fmt).unwrap();
            let h2 = HostWeight::from_f32("markov_w2", vocab, rank, &w2v, fmt).unwrap();
            let logits = rand_vec(&mut r, n * vocab, 4.0);
            let mut lc = logits.clone();
            let tc = cpu
                .markov_chain(
                    &mut lc,
                    n,
                    vocab,
                    17,
                    &cpu.upload_weight(&h1).unwrap(),
                    &cpu.upload_weight(&h2).unwrap(),
                )
                .unwrap();
            let mut lg = g.upload(&logits).unwrap();
            let tg = g
                .markov_chain(
                    &mut lg,
                    n,
                    vocab,
                    17,
                    &g.upload_weight(&h1).unwrap(),
                    &g.upload_weight(&h2).unwrap(),
                )
                .unwrap();
            assert_eq!(tc, tg, "{fmt:?} rank {rank}: Markov chain tokens differ");
            report(
                &format!("markov_chain logits {fmt:?} rank {rank} (tokens identical)"),
                &g.download(&lg).unwrap(),
                &lc,
                2e-5,
            );
        }
    }
}

/// The tensor-core Markov step (bf16 in fragment order, q8_0, q4_0; the default) against the
/// lane-contiguous CUDA-core kernels (`set_markov_mma(false)`): the same tokens, logits within
/// f32 rounding of each other (another summation order; emb as bf16 hi + lo), at the 8B
/// vocabulary and at a vocabulary that leaves a ragged last tile.
#[test]
fn markov_chain_mma_matches_the_lane_kernels() {
    let Some(g) = private_gpu("markov_chain_mma_matches_the_lane_kernels") else {
        return;
    };
    let mut r = rng("markov_chain_mma_matches_the_lane_kernels");
    for (vocab, rank, n) in [(151936usize, 256usize, 15usize), (10007, 96, 5)] {
        let w1v = rand_vec(&mut r, vocab * rank, 1.0);
        let w2v = rand_vec(&mut r, vocab * rank, 0.2);
        let logits = rand_vec(&mut r, n * vocab, 4.0);
        for fmt in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let h1 = HostWeight::from_f32("markov_w1", vocab, rank, &w1v, fmt).unwrap();
            let h2 = HostWeight::from_f32("markov_w2", vocab, rank, &w2v, fmt).unwrap();
            let (w1, w2) = (g.upload_weight(&h1).unwrap(), g.upload_weight(&h2).unwrap());
            let mut out = Vec::new();
            for mma in [false, true] {
                g.set_markov_mma(mma);
                let mut lg = g.upload(&logits).unwrap();
                let toks = g.markov_chain(&mut lg, n, vocab, 17, &w1, &w2).unwrap();
                out.push((toks, g.download(&lg).unwrap()));
            }
            g.set_markov_mma(true);
            let what = format!("markov_chain mma vs lanes {fmt:?} vocab {vocab} rank {rank}");
            assert_eq!(out[1].0, out[0].0, "{what}: tokens");
            report(&what, &out[1].1, &out[0].1, 2e-5);
        }
    }
}

/// The persistent Q8_0A8 Markov chain (one cooperative launch, the default) gives the tokens and
/// the logits bits of the step kernels (`set_markov_persistent(false)`): W2 tiles kept in shared
/// memory and streamed (the 8B vocabulary), more blocks per row than the streamed tiles' register
/// prefetch holds (rank 320), and more multiprocessors than tiles (vocabulary 40).
#[test]
fn markov_chain_persistent_equals_the_step_kernels_bit_for_bit() {
    let Some(g) = private_gpu("markov_chain_persistent_equals_the_step_kernels_bit_for_bit") else {
        return;
    };
    let mut r = rng("markov_chain_persistent_equals_the_step_kernels_bit_for_bit");
    for (vocab, rank, n) in [
        (151936usize, 256usize, 15usize),
        (120000, 320, 4),
        (4000, 64, 3),
        (40, 32, 2),
    ] {
        let w1v = rand_vec(&mut r, vocab * rank, 1.0);
        let w2v = rand_vec(&mut r, vocab * rank, 0.2);
        let h1 =
            HostWeight::from_f32("markov_w1", vocab, rank, &w1v, WeightFormat::Q8_0A8).unwrap();
        let h2 =
            HostWeight::from_f32("markov_w2", vocab, rank, &w2v, WeightFormat::Q8_0A8).unwrap();
        let (w1, w2) = (g.upload_weight(&h1).unwrap(), g.upload_weight(&h2).unwrap());
        let logits = rand_vec(&mut r, n * vocab, 4.0);
        let mut out = Vec::new();
        for persistent in [false, true] {
            g.set_markov_persistent(persistent);
            let mut lg = g.upload(&logits).unwrap();
            let toks = g.markov_chain(&mut lg, n, vocab, 17, &w1, &w2).unwrap();
            out.push((toks, g.download(&lg).unwrap()));
        }
        let what = format!("vocab {vocab} rank {rank} n {n}");
        assert_eq!(out[1].0, out[0].0, "{what}: tokens");
        assert_same_bits(&what, &out[1].1, &out[0].1);
    }
    eprintln!("EXACT the persistent Markov chain == the step kernels (tokens and logits)");
}

fn assert_same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: index {i}: got {} vs expected {} ({} of {} differ)",
            got[i],
            want[i],
            got.iter()
                .zip(want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count(),
            got.len()
        );
    }
}

/// Which attention op a check calls.
#[derive(Clone, Copy, PartialEq)]
enum Op {
    Exact,
    Fast,
    /// `attention_fast_kv16` (k and v hold f16).
    FastKv16,
}

/// Queries 0, 7 and 15 (the last, in fewer) of the block `q` (the call `p`, whose output is `all`), each alone in a
/// 1-query call (causal: over the keys up to its own position, i.e. a decode), give the bits of
/// their rows of `all`; through the op `op`.
#[allow(clippy::too_many_arguments)]
fn assert_rows_alone_equal(
    g: &dflash_cuda_kernels::Cuda,
    q: &[f32],
    k: &dflash_cuda_kernels::CudaBuf,
    v: &dflash_cuda_kernels::CudaBuf,
    p: &AttnParams,
    all: &[f32],
    op: Op,
    what: &str,
) {
    let w = p.n_heads * p.head_dim;
    let last = p.n_q - 1;
    for i in [0usize, 7.min(last), 15.min(last)] {
        let qi = g.upload(&q[i * w..(i + 1) * w]).unwrap();
        let pi = AttnParams {
            n_q: 1,
            n_kv: if p.causal {
                p.q_pos0 - p.kv_pos0 + i + 1
            } else {
                p.n_kv
            },
            q_pos0: p.q_pos0 + i,
            ..*p
        };
        let mut o = poisoned(g, w);
        match op {
            Op::Exact => g.attention(&qi, k, v, &pi, &mut o).unwrap(),
            Op::Fast => g.attention_fast(&qi, k, v, &pi, &mut o).unwrap(),
            Op::FastKv16 => g.attention_fast_kv16(&qi, k, v, &pi, &mut o).unwrap(),
        }
        assert_same_bits(
            &format!("{what}: query {i} alone vs the {}-query call", p.n_q),
            &g.download(&o).unwrap(),
            &all[i * w..(i + 1) * w],
        );
    }
}

/// `norm_matmul_many` of 4 and 5 bf16 / q8_0 / q4_0 matrices (a Gated DeltaNet layer's q / k
/// / v, z, b, a; the norm writes the skinny kernels' x, read by launches of up to 4) gives the
/// bits of `rms_norm` then `matmul_many`, and matches the CPU, at 1 and 16 rows.
#[test]
fn norm_matmul_many_skinny_groups_of_four() {
    let Some(g) = gpu("norm_matmul_many_skinny_groups_of_four") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("norm_matmul_many_skinny_groups_of_four");
    let d = 1024usize;
    let ln = rand_vec(&mut r, d, 1.0);
    let (lng, lnc) = (g.upload(&ln).expect("ln"), cpu.upload(&ln).expect("ln"));
    for ns in [vec![2048usize, 1024, 48, 48], vec![512, 256, 48, 1000, 64]] {
        for fmt in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let (wgs, wcs) = weights_on_both(g, &cpu, &mut r, &ns, d, fmt);
            let ws: Vec<_> = wgs.iter().collect();
            let wsc: Vec<_> = wcs.iter().collect();
            for rows in [1usize, 16] {
                let what = format!("norm_matmul_many {fmt:?} n={ns:?} rows={rows}");
                let xv = rand_vec(&mut r, rows * d, 2.0);
                let xg = g.upload(&xv).expect("x");
                let mut xn = poisoned(g, rows * d);
                let mut fused: Vec<_> = ns.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut outs: Vec<_> = fused.iter_mut().collect();
                g.norm_matmul_many(&xg, &lng, d, 1e-6, &mut xn, rows, &ws, &mut outs)
                    .expect("norm_matmul_many");
                let mut xn2 = poisoned(g, rows * d);
                g.rms_norm(&xg, &lng, d, 1e-6, &mut xn2).expect("rms_norm");
                let mut sep: Vec<_> = ns.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut outs: Vec<_> = sep.iter_mut().collect();
                g.matmul_many(&xn2, rows, &ws, &mut outs)
                    .expect("matmul_many");
                let mut xnc = vec![0.0f32; rows * d];
                let mut want: Vec<_> = ns.iter().map(|&n| vec![0.0f32; rows * n]).collect();
                let mut outc: Vec<_> = want.iter_mut().collect();
                cpu.norm_matmul_many(&xv, &lnc, d, 1e-6, &mut xnc, rows, &wsc, &mut outc)
                    .expect("cpu");
                for i in 0..ns.len() {
                    let got = g.download(&fused[i]).expect("dl");
                    assert_same_bits(
                        &format!("{what} #{i}: fused vs rms_norm + matmul_many"),
                        &got,
                        &g.download(&sep[i]).expect("dl"),
                    );
                    report(&format!("{what} #{i}"), &got, &want[i], matmul_tol(fmt));
                }
            }
        }
    }
    eprintln!(
        "norm_matmul_many of 4 and 5 skinny matrices == rms_norm + matmul_many bit for bit, == CPU"
    );
}

/// The fused launches of the drafter step (`add_rms_norm`, `qk_norm_rope_kv`,
/// `matmul_silu_mul`) against the separate backend ops they replace, bit for bit.
/// matmul_many of bf16 / q8_0 / q4_0 matrices runs one skinny launch per 16 rows, its split-k
/// chosen for the matrices together: each output against the CPU's matmul of its matrix, and
/// each row's bits equal to the same row run alone (the decode == verify-row property the
/// targets' exactness rests on). Split and unsplit launches, ragged N, tall matrices (their
/// own 64-row kernel), 1-5 matrices (launches of up to 4: a Gated DeltaNet layer's q / k / v,
/// z, b and a in one), 1-16 rows and more (launches of 16).
#[test]
fn matmul_many_skinny_matches_cpu_and_is_per_row_deterministic() {
    let Some(g) = gpu("matmul_many_skinny_matches_cpu_and_is_per_row_deterministic") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("matmul_many_skinny_matches_cpu_and_is_per_row_deterministic");
    for &(k, ref ns) in &[
        (4096usize, vec![4096usize, 1024, 1024]),
        (1024, vec![3000, 77]),
        (4096, vec![12288, 12288]),
        (96, vec![40000, 300, 20000]),
        (12288, vec![4096]),
        (5120, vec![10240, 6144, 48, 48]),
        (1024, vec![512, 256, 48, 1000, 64]),
    ] {
        for fmt in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let (wgs, wcs) = weights_on_both(g, &cpu, &mut r, ns, k, fmt);
            let ws: Vec<_> = wgs.iter().collect();
            for rows in [1usize, 8, 9, 16, 20] {
                let xv = rand_vec(&mut r, rows * k, 2.0);
                let xg = g.upload(&xv).expect("x");
                let mut many: Vec<_> = ns.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut outs: Vec<_> = many.iter_mut().collect();
                g.matmul_many(&xg, rows, &ws, &mut outs)
                    .expect("matmul_many");
                let got: Vec<_> = many.iter().map(|o| g.download(o).expect("dl")).collect();
                for (i, wc) in wcs.iter().enumerate() {
                    let mut want = vec![0.0f32; rows * ns[i]];
                    cpu.matmul(&xv, rows, wc, &mut want).expect("cpu matmul");
                    report(
                        &format!("matmul_many {fmt:?} k={k} n={ns:?} #{i} rows={rows}"),
                        &got[i],
                        &want,
                        matmul_tol(fmt),
                    );
                }
                // Every row alone: the same bits (bf16 prefills of more than 16 rows run on
                // cuBLAS, which the options document as not per-row deterministic).
                let rows_checked = if fmt == WeightFormat::Bf16 && rows > 16 {
                    0
                } else {
                    rows
                };
                for row in 0..rows_checked {
                    let x1 = g.upload(&xv[row * k..(row + 1) * k]).expect("x row");
                    let mut one: Vec<_> = ns.iter().map(|&n| poisoned(g, n)).collect();
                    let mut outs: Vec<_> = one.iter_mut().collect();
                    g.matmul_many(&x1, 1, &ws, &mut outs)
                        .expect("matmul_many row");
                    for (i, o) in one.iter().enumerate() {
                        assert_same_bits(
                            &format!("matmul_many {fmt:?} k={k} n={ns:?} #{i} row {row} of {rows}"),
                            &g.download(o).expect("dl"),
                            &got[i][row * ns[i]..(row + 1) * ns[i]],
                        );
                    }
                }
            }
        }
    }
    eprintln!("matmul_many (bf16 / q8_0 / q4_0, one launch per 16 rows) == CPU; rows alone == rows together, bit for bit");
}

#[test]
fn glu_launch_equals_gate_up_then_silu_bit_for_bit() {
    // A backend of its own: another test's launch on a shared one could make an activation
    // stale between two of these calls.
    let Some(g) = private_gpu("glu_launch_equals_gate_up_then_silu_bit_for_bit") else {
        return;
    };
    let g = &g;
    g.set_poison_scratch(true);
    let cpu = Cpu::new();
    let mut r = rng("glu_launch_equals_gate_up_then_silu_bit_for_bit");
    let eps = 1e-6f32;
    let mut compared = 0usize;
    // (hidden, intermediate): split-k of 1 and more, 32- and 64-row kernels, the 8B and 27B
    // MLP shapes.
    for &(k, n) in &[
        (256usize, 96usize),
        (512, 1024),
        (1024, 3072),
        (4096, 12288),
        (5120, 17408),
    ] {
        for fmt in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4_0] {
            let (w, _) = weights_on_both(g, &cpu, &mut r, &[n, n], k, fmt);
            let (wd, _) = weights_on_both(g, &cpu, &mut r, &[256], n, fmt);
            let nw = g.upload(&rand_vec(&mut r, k, 1.5)).expect("norm w");
            for rows in [1usize, 5, 9, 16] {
                let what = format!("{fmt:?} K={k} n={n} rows={rows}");
                let x = g.upload(&rand_vec(&mut r, rows * k, 2.0)).expect("x");
                // The GLU launch, then the down projection of its output.
                let act = g.rms_norm_split(&x, &nw, k, eps, rows).expect("norm");
                let act2 = g
                    .matmul_glu_split(&act, &w[0], &w[1])
                    .expect("glu")
                    .unwrap_or_else(|| panic!("{what}: the GLU launch declined"));
                // A write of the first pair leaves the second current.
                g.rms_norm_split(&x, &nw, k, eps, rows).expect("norm");
                let mut out1 = poisoned(g, rows * 256);
                assert!(
                    g.matmul_many_split(&act2, &[&wd[0]], &mut [&mut out1], false)
                        .expect("down"),
                    "{what}: the GLU output went stale"
                );
                // The separate launches: gate / up, the SiLU product, the down projection.
                let act = g.rms_norm_split(&x, &nw, k, eps, rows).expect("norm");
                let (mut gate, mut up) = (poisoned(g, rows * n), poisoned(g, rows * n));
                assert!(g
                    .matmul_many_split(&act, &[&w[0], &w[1]], &mut [&mut gate, &mut up], false)
                    .expect("gate / up"));
                let act3 = g.silu_mul_split(&gate, &up, rows, n).expect("silu");
                let mut out2 = poisoned(g, rows * 256);
                assert!(g
                    .matmul_many_split(&act3, &[&wd[0]], &mut [&mut out2], false)
                    .expect("down"));
                assert_same_bits(
                    &what,
                    &g.download(&out1).expect("dl"),
                    &g.download(&out2).expect("dl"),
                );
                compared += 1;
            }
            // A second GLU launch makes the first one's output stale: nothing launched.
            let x = g.upload(&rand_vec(&mut r, k, 2.0)).expect("x");
            let act = g.rms_norm_split(&x, &nw, k, eps, 1).expect("norm");
            let first = g
                .matmul_glu_split(&act, &w[0], &w[1])
                .expect("glu")
                .expect("glu");
            g.matmul_glu_split(&act, &w[0], &w[1])
                .expect("glu")
                .expect("glu");
            let mut out = poisoned(g, 256);
            assert!(!g
                .matmul_many_split(&first, &[&wd[0]], &mut [&mut out], false)
                .expect("stale down"));
        }
    }
    assert_eq!(compared, 60);
    // Off: no launch.
    g.set_skinny_glu(false);
    let (w, _) = weights_on_both(g, &cpu, &mut r, &[64, 64], 64, WeightFormat::Bf16);
    let nw = g.upload(&rand_vec(&mut r, 64, 1.5)).expect("norm w");
    let x = g.upload(&rand_vec(&mut r, 64, 2.0)).expect("x");
    let act = g.rms_norm_split(&x, &nw, 64, eps, 1).expect("norm");
    assert!(g
        .matmul_glu_split(&act, &w[0], &w[1])
        .expect("glu")
        .is_none());
    eprintln!("EXACT the GLU launch == gate / up + silu_mul_split: {compared} cases bit for bit");
}

#[test]
fn fused_ops_equal_the_separate_ops_bit_for_bit() {
    let Some(g) = gpu("fused_ops_equal_the_separate_ops_bit_for_bit") else {
        return;
    };
    let mut r = rng("fused_ops_equal_the_separate_ops_bit_for_bit");
    let eps = 1e-6f32;
    // Residual add + RMSNorm (9000: wider than the register tile -> the two-op path).
    for &(rows, dim) in &[
        (1usize, 4096usize),
        (16, 4096),
        (16, 5120),
        (7, 100),
        (3, 128),
        (2, 9000),
    ] {
        let h = rand_vec(&mut r, rows * dim, 2.0);
        let o = rand_vec(&mut r, rows * dim, 2.0);
        let w = rand_vec(&mut r, dim, 1.5);
        let (og, wg) = (g.upload(&o).expect("o"), g.upload(&w).expect("w"));
        let mut h1 = g.upload(&h).expect("h");
        let mut out1 = poisoned(g, rows * dim);
        g.add_rms_norm(&mut h1, &og, &wg, rows, dim, eps, &mut out1)
            .expect("fused");
        let mut h2 = g.upload(&h).expect("h");
        let mut out2 = poisoned(g, rows * dim);
        g.add_assign(&mut h2, 0, &og, rows * dim).expect("add");
        g.rms_norm(&h2, &wg, dim, eps, &mut out2).expect("norm");
        let what = format!("add_rms_norm rows={rows} dim={dim}");
        assert_same_bits(
            &format!("{what} h"),
            &g.download(&h1).expect("dl"),
            &g.download(&h2).expect("dl"),
        );
        assert_same_bits(
            &format!("{what} out"),
            &g.download(&out1).expect("dl"),
            &g.download(&out2).expect("dl"),
        );
    }
    eprintln!("EXACT add_rms_norm == add_assign + rms_norm");
    // q/k RMSNorm + RoPE + K/V cache write.
    for &(rows, nh, nkv, hd, rot, pos0, row0, att) in &[
        (
            16usize, 32usize, 8usize, 128usize, 128usize, 512usize, 512usize, 1.0f32,
        ),
        (1, 32, 8, 128, 128, 8192, 8192, 1.0),
        (5, 4, 2, 64, 32, 100000, 3, 1.25),
        (3, 6, 2, 256, 256, 7, 0, 0.9),
        (2, 3, 1, 48, 16, 40, 9, 1.0),
        // A prefill's rows (more than 16: one block per row, `qk_norm_rope_kv_rows`).
        (40, 32, 8, 128, 128, 0, 0, 1.0),
        (17, 4, 2, 64, 32, 100000, 3, 1.25),
        (33, 6, 2, 256, 64, 7, 5, 0.9),
        (24, 3, 1, 48, 16, 40, 9, 1.0),
    ] {
        let spec = RopeSpec {
            inv_freq: (0..rot / 2)
                .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / rot as f32) * (1.0 + 0.1 * i as f32))
                .collect(),
            attention_scaling: att,
        };
        let (qw, kvw) = (nh * hd, nkv * hd);
        let cap = row0 + rows + 2;
        let q0 = g.upload(&rand_vec(&mut r, rows * qw, 3.0)).expect("q0");
        let k0 = g.upload(&rand_vec(&mut r, rows * kvw, 3.0)).expect("k0");
        let v = g.upload(&rand_vec(&mut r, rows * kvw, 3.0)).expect("v");
        let qn = g.upload(&rand_vec(&mut r, hd, 1.5)).expect("qn");
        let kn = g.upload(&rand_vec(&mut r, hd, 1.5)).expect("kn");
        let kc0 = rand_vec(&mut r, cap * kvw, 1.0);
        let vc0 = rand_vec(&mut r, cap * kvw, 1.0);
        let mut qf = poisoned(g, rows * qw);
        let mut kcf = g.upload(&kc0).expect("kc");
        let mut vcf = g.upload(&vc0).expect("vc");
        let p = QkNormRope {
            q_norm: &qn,
            k_norm: &kn,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            eps,
            pos0,
            rope: &spec,
        };
        let mut kf = poisoned(g, rows * kvw);
        let cache = KvCacheRows {
            k: &mut kcf,
            v: &mut vcf,
            row0,
            storage: KvStorage::F32,
        };
        Backend::qk_norm_rope_kv(g, &q0, &k0, &v, rows, rows, &p, &mut qf, &mut kf, cache)
            .expect("fused");
        let mut qs = poisoned(g, rows * qw);
        let mut ks = poisoned(g, rows * kvw);
        let mut kcs = g.upload(&kc0).expect("kc");
        let mut vcs = g.upload(&vc0).expect("vc");
        g.rms_norm(&q0, &qn, hd, eps, &mut qs).expect("qn");
        g.rms_norm(&k0, &kn, hd, eps, &mut ks).expect("kn");
        g.rope(&mut qs, rows, nh, hd, pos0, &spec).expect("rope q");
        g.rope(&mut ks, rows, nkv, hd, pos0, &spec).expect("rope k");
        g.copy(&ks, 0, &mut kcs, row0 * kvw, rows * kvw)
            .expect("k copy");
        g.copy(&v, 0, &mut vcs, row0 * kvw, rows * kvw)
            .expect("v copy");
        let what = format!("qk_norm_rope_kv rows={rows} heads={nh}/{nkv} hd={hd} rot={rot}");
        assert_same_bits(
            &format!("{what} q"),
            &g.download(&qf).expect("dl"),
            &g.download(&qs).expect("dl"),
        );
        assert_same_bits(
            &format!("{what} k cache"),
            &g.download(&kcf).expect("dl"),
            &g.download(&kcs).expect("dl"),
        );
        assert_same_bits(
            &format!("{what} v cache"),
            &g.download(&vcf).expect("dl"),
            &g.download(&vcs).expect("dl"),
        );
        // Fewer q rows than k / v rows (the drafter's last layer, its ingest with none): its
        // q rows, K and V caches the same bits.
        let q_rows = rows.div_ceil(2);
        let mut qt = poisoned(g, rows * qw);
        let mut kt = poisoned(g, rows * kvw);
        let (mut kct, mut vct) = (g.upload(&kc0).expect("kc"), g.upload(&vc0).expect("vc"));
        let cache = KvCacheRows {
            k: &mut kct,
            v: &mut vct,
            row0,
            storage: KvStorage::F32,
        };
        Backend::qk_norm_rope_kv(g, &q0, &k0, &v, q_rows, rows, &p, &mut qt, &mut kt, cache)
            .expect("trait");
        assert_same_bits(
            &format!("{what} trait q ({q_rows} rows)"),
            &g.download(&qt).expect("dl")[..q_rows * qw],
            &g.download(&qs).expect("dl")[..q_rows * qw],
        );
        assert_same_bits(
            &format!("{what} trait k cache"),
            &g.download(&kct).expect("dl"),
            &g.download(&kcs).expect("dl"),
        );
        assert_same_bits(
            &format!("{what} trait v cache"),
            &g.download(&vct).expect("dl"),
            &g.download(&vcs).expect("dl"),
        );
        // An f16 cache: the K / V rows of the f32 op, f16_pack'ed (the fused kernel's kv16
        // writes, or the separate ops + f16_pack where it does not take the shape); the rows
        // around them untouched.
        let (mut k16, mut v16) = (
            g.upload(&kc0[..cap * kvw / 2]).expect("kc16"),
            g.upload(&vc0[..cap * kvw / 2]).expect("vc16"),
        );
        let (k16_0, v16_0) = (g.download(&k16).expect("dl"), g.download(&v16).expect("dl"));
        let mut qh = poisoned(g, rows * qw);
        let cache = KvCacheRows {
            k: &mut k16,
            v: &mut v16,
            row0,
            storage: KvStorage::F16,
        };
        Backend::qk_norm_rope_kv(g, &q0, &k0, &v, rows, rows, &p, &mut qh, &mut kt, cache)
            .expect("f16 cache");
        assert_same_bits(
            &format!("{what} q (f16 cache)"),
            &g.download(&qh).expect("dl"),
            &g.download(&qs).expect("dl"),
        );
        for (name, got, f32c, c0) in [("k", &k16, &kcs, &k16_0), ("v", &v16, &vcs, &v16_0)] {
            let mut want = g.upload(c0).expect("want");
            let rows_f32 = g.download(f32c).expect("dl")[row0 * kvw..(row0 + rows) * kvw].to_vec();
            let rows_f32 = g.upload(&rows_f32).expect("rows");
            g.f16_pack(&rows_f32, &mut want, row0 * kvw, rows * kvw)
                .expect("pack");
            assert_same_bits(
                &format!("{what} {name} cache (f16)"),
                &g.download(got).expect("dl"),
                &g.download(&want).expect("dl"),
            );
        }
        // More q rows than k / v rows: an error, nothing written.
        let cache = KvCacheRows {
            k: &mut kct,
            v: &mut vct,
            row0,
            storage: KvStorage::F32,
        };
        assert!(Backend::qk_norm_rope_kv(
            g,
            &q0,
            &k0,
            &v,
            rows + 1,
            rows,
            &p,
            &mut qt,
            &mut kt,
            cache
        )
        .is_err());
    }
    eprintln!("EXACT qk_norm_rope_kv (all q rows and fewer, f32 and f16 caches, 1-16 rows and a prefill's) == rms_norm x2 + rope x2 + copy x2 (+ f16_pack)");
    // SiLU * up into the down projection.
    for f in [WeightFormat::Q8_0A8, WeightFormat::Q8_0, WeightFormat::Bf16] {
        for &(n, k) in &[(4096usize, 12288usize), (300, 416)] {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let w = g
                .upload_weight(&HostWeight::from_f32("wd", n, k, &wv, f).expect("encode"))
                .expect("w");
            for rows in [1usize, 9, 16, 20] {
                let gate = g.upload(&rand_vec(&mut r, rows * k, 4.0)).expect("gate");
                let up = g.upload(&rand_vec(&mut r, rows * k, 2.0)).expect("up");
                let mut actf = poisoned(g, rows * k);
                let mut outf = poisoned(g, rows * n);
                g.matmul_silu_mul(&gate, &up, &mut actf, rows, &w, &mut outf)
                    .expect("fused");
                let mut acts = poisoned(g, rows * k);
                let mut outs = poisoned(g, rows * n);
                g.silu_mul(&gate, &up, &mut acts).expect("silu");
                g.matmul(&acts, rows, &w, &mut outs).expect("matmul");
                assert_same_bits(
                    &format!("matmul_silu_mul {f:?} n={n} k={k} rows={rows}"),
                    &g.download(&outf).expect("dl"),
                    &g.download(&outs).expect("dl"),
                );
            }
        }
    }
    eprintln!("EXACT matmul_silu_mul == silu_mul + matmul (q8_0a8, q8_0, bf16)");
}

/// The attention split size is a per-backend knob: with 64 and 128 keys per split the
/// kernel still matches the CPU (up to 313 splits: several combine tiles) and decode == verify
/// bit for bit.
#[test]
fn attention_other_split_sizes() {
    let Some(g) = private_gpu("attention_other_split_sizes") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("attention_other_split_sizes");
    assert!(g.set_attn_split(100).is_err(), "split 100 accepted");
    for split in [64usize, 128] {
        g.set_attn_split(split).expect("split");
        for &(nq, nkv, h, hkv, d, causal, win) in &[
            (16usize, 528usize, 32usize, 8usize, 128usize, false, None),
            (16, 700, 8, 2, 64, true, Some(256usize)),
            (1, 8193, 32, 8, 128, true, None),
            (5, 130, 4, 4, 256, true, None),
            // More splits than the combine prefetches (16) and than one combine tile (256),
            // with and without dead splits before the live ones.
            (2, 20000, 8, 2, 128, false, None),
            (3, 20000, 8, 2, 64, true, Some(5000)),
        ] {
            let p = AttnParams {
                n_q: nq,
                n_kv: nkv,
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: d,
                q_pos0: nkv - nq,
                kv_pos0: 0,
                causal,
                window: win,
                scale: (d as f32).powf(-0.5),
            };
            attn_case(&g, &cpu, &mut r, p, nkv + 3);
        }
        // Decode of queries 0 / 7 / 15 == the 16-query verify.
        let (ctx, hd, h, hkv, nq) = (1000usize, 128usize, 32usize, 8usize, 16usize);
        let cap = ctx + nq;
        let q = rand_vec(&mut r, nq * h * hd, 1.5);
        let k = g.upload(&rand_vec(&mut r, cap * hkv * hd, 1.5)).unwrap();
        let v = g.upload(&rand_vec(&mut r, cap * hkv * hd, 1.0)).unwrap();
        let p = AttnParams {
            n_q: nq,
            n_kv: cap,
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: hd,
            q_pos0: ctx,
            kv_pos0: 0,
            causal: true,
            window: None,
            scale: (hd as f32).powf(-0.5),
        };
        let qg = g.upload(&q).unwrap();
        let mut all = poisoned(&g, nq * h * hd);
        g.attention(&qg, &k, &v, &p, &mut all).unwrap();
        let all = g.download(&all).unwrap();
        assert_rows_alone_equal(
            &g,
            &q,
            &k,
            &v,
            &p,
            &all,
            Op::Exact,
            &format!("split {split}: decode vs verify"),
        );
        eprintln!("attention split {split}: matches the CPU; decode == verify bit for bit");
    }
}

/// Every attention kernel choice (the f32 SIMT split kernel, the 3xTF32 tensor-core kernel
/// with 2 or 4 key warps, 1 / 2 / 4 / auto row warps, 1 / 2 / 3 / auto pipeline stages, P V on
/// the tensor or the CUDA cores) matches the CPU on the mask cases, decode == verify bit for
/// bit under each, and neither the row warps per block nor the stages change a bit (Auto ==
/// its explicit kernel, too).
#[test]
fn attention_kernel_choices() {
    let Some(g) = private_gpu("attention_kernel_choices") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("attention_kernel_choices");
    assert!(g
        .set_attn_kernel(AttnKernel::Tc {
            key_warps: 3,
            row_warps: 0,
            ffma_pv: false,
            stages: 0
        })
        .is_err());
    assert!(g
        .set_attn_kernel(AttnKernel::Tc {
            key_warps: 4,
            row_warps: 0,
            ffma_pv: false,
            stages: 4
        })
        .is_err());
    assert!(g
        .set_attn_kernel(AttnKernel::Tc {
            key_warps: 4,
            row_warps: 3,
            ffma_pv: true,
            stages: 0
        })
        .is_err());
    let tc = |key_warps, row_warps, ffma_pv| AttnKernel::Tc {
        key_warps,
        row_warps,
        ffma_pv,
        stages: 0,
    };
    let tcs = |key_warps, row_warps, stages| AttnKernel::Tc {
        key_warps,
        row_warps,
        ffma_pv: false,
        stages,
    };
    let choices = [
        AttnKernel::Auto,
        AttnKernel::Simt,
        tc(2, 0, false),
        tc(2, 1, false),
        tc(2, 4, false),
        tc(4, 1, false),
        tc(4, 2, false),
        tc(4, 4, false),
        tcs(4, 1, 1),
        tcs(4, 2, 1),
        tcs(4, 4, 1),
        tcs(4, 1, 2),
        tcs(4, 1, 3),
        tcs(4, 0, 1),
        tcs(2, 1, 1),
        tcs(2, 4, 1),
        tcs(2, 2, 3),
        tc(2, 0, true),
        tc(2, 1, true),
        tc(2, 4, true),
        tc(4, 0, true),
        tc(4, 1, true),
        tc(4, 2, true),
        tc(4, 4, true),
        AttnKernel::Tc {
            key_warps: 4,
            row_warps: 0,
            ffma_pv: true,
            stages: 1,
        },
    ];
    let base = AttnParams {
        n_q: 16,
        n_kv: 528,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        q_pos0: 512,
        kv_pos0: 0,
        causal: false,
        window: None,
        scale: 128f32.powf(-0.5),
    };
    let cases = [
        base,
        AttnParams {
            n_kv: 8208,
            q_pos0: 8192,
            window: Some(2048),
            ..base
        },
        AttnParams {
            n_kv: 3000,
            q_pos0: 2990,
            causal: true,
            window: Some(700),
            ..base
        },
        AttnParams {
            n_q: 1,
            n_kv: 77,
            q_pos0: 76,
            causal: true,
            ..base
        },
        AttnParams {
            n_q: 40,
            n_kv: 300,
            q_pos0: 260,
            causal: true,
            n_heads: 16,
            n_kv_heads: 2,
            head_dim: 64,
            ..base
        },
        AttnParams {
            n_q: 9,
            n_kv: 70,
            q_pos0: 61,
            causal: true,
            n_heads: 6,
            n_kv_heads: 3,
            head_dim: 32,
            ..base
        },
        AttnParams {
            n_q: 3,
            n_kv: 40,
            q_pos0: 0,
            kv_pos0: 10,
            causal: true,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 64,
            ..base
        },
        AttnParams {
            n_q: 16,
            n_kv: 1000,
            q_pos0: 5000,
            kv_pos0: 4016,
            causal: true,
            window: Some(512),
            ..base
        },
        AttnParams {
            n_q: 33,
            n_kv: 4100,
            q_pos0: 4067,
            causal: false,
            window: Some(1000),
            n_heads: 12,
            n_kv_heads: 4,
            ..base
        },
    ];
    for p in cases {
        let q = rand_vec(&mut r, p.n_q * p.n_heads * p.head_dim, 1.5);
        let k = rand_vec(&mut r, p.n_kv * p.n_kv_heads * p.head_dim, 1.5);
        let v = rand_vec(&mut r, p.n_kv * p.n_kv_heads * p.head_dim, 1.0);
        let (oc, qg, kg, vg) = attn_reference(&g, &cpu, &q, &k, &v, &p);
        let mut by_kw: Vec<((usize, bool), Vec<f32>)> = Vec::new();
        for c in choices {
            g.set_attn_kernel(c).unwrap();
            let mut og = poisoned(&g, oc.len());
            g.attention(&qg, &kg, &vg, &p, &mut og).unwrap();
            let o = g.download(&og).unwrap();
            report(
                &format!(
                    "attention {c:?} nq={} nkv={} h={}/{} d={} causal={} win={:?} kv0={}",
                    p.n_q,
                    p.n_kv,
                    p.n_heads,
                    p.n_kv_heads,
                    p.head_dim,
                    p.causal,
                    p.window,
                    p.kv_pos0
                ),
                &o,
                &oc,
                2e-5,
            );
            // Auto over a prefill's rows (causal, more than 16) runs the FA prefill kernels,
            // bits of their own (`attention_prefill_fa_against_cpu`).
            if c == AttnKernel::Auto && p.causal && p.n_q > 16 {
                continue;
            }
            // Row warps per block never change the bits (same key warps).
            let kw = match c.resolve() {
                AttnKernel::Tc {
                    key_warps, ffma_pv, ..
                } => (key_warps, ffma_pv),
                _ => continue,
            };
            if let Some((_, first)) = by_kw.iter().find(|(w, _)| *w == kw) {
                assert_same_bits(&format!("attention {c:?} vs other row warps"), &o, first);
            } else {
                by_kw.push((kw, o));
            }
        }
    }
    // Decode of queries 0 / 7 / 15 == the 16-query verify, under every choice.
    let (ctx, hd, h, hkv, nq) = (1500usize, 128usize, 32usize, 8usize, 16usize);
    let cap = ctx + nq;
    let q = rand_vec(&mut r, nq * h * hd, 1.5);
    let k = g.upload(&rand_vec(&mut r, cap * hkv * hd, 1.5)).unwrap();
    let v = g.upload(&rand_vec(&mut r, cap * hkv * hd, 1.0)).unwrap();
    for win in [None, Some(300usize)] {
        let p = AttnParams {
            n_q: nq,
            n_kv: cap,
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: hd,
            q_pos0: ctx,
            kv_pos0: 0,
            causal: true,
            window: win,
            scale: (hd as f32).powf(-0.5),
        };
        let qg = g.upload(&q).unwrap();
        for c in choices {
            g.set_attn_kernel(c).unwrap();
            let mut all = poisoned(&g, nq * h * hd);
            g.attention(&qg, &k, &v, &p, &mut all).unwrap();
            let all = g.download(&all).unwrap();
            assert_rows_alone_equal(
                &g,
                &q,
                &k,
                &v,
                &p,
                &all,
                Op::Exact,
                &format!("{c:?} win {win:?}: decode vs verify"),
            );
        }
    }
    eprintln!("attention kernel choices: all match the CPU; decode == verify bit for bit; row warps and stages never change a bit");
}

/// Head dim 256 (the hybrid target's attention layers): the automatic choice runs the 3xTF32
/// tensor-core split kernel with 2 key warps, which matches the CPU, gives the bits of its
/// explicit choice under any row warps and stages, and keeps decode == verify bit for bit
/// (exact and fast ops, the Qwen3.5 heads 24 / 4 over 300 and 5000 keys, windowed too); the
/// SIMT kernel (`AttnKernel::Simt`) matches the CPU with bits of its own, and 4 key warps or P V
/// on the CUDA cores (no such kernel at 256) run it.
#[test]
fn attention_head_dim_256() {
    let Some(g) = private_gpu("attention_head_dim_256") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("attention_head_dim_256");
    let tcs = |key_warps, row_warps, ffma_pv, stages| AttnKernel::Tc {
        key_warps,
        row_warps,
        ffma_pv,
        stages,
    };
    let tc2 = [
        tcs(2, 0, false, 0),
        tcs(2, 1, false, 0),
        tcs(2, 2, false, 0),
        tcs(2, 4, false, 0),
        tcs(2, 1, false, 1),
        tcs(2, 1, false, 3),
        tcs(2, 4, false, 2),
    ];
    let simt_like = [AttnKernel::Simt, tcs(4, 0, false, 0), tcs(2, 0, true, 0)];
    for &(ctx, win, nq, causal) in &[
        (300usize, None, 16usize, true),
        (5000, None, 16, true),
        (5000, Some(700usize), 16, true),
        (5000, None, 1, true),
        (2990, Some(1000), 33, false),
        (1500, None, 9, false),
    ] {
        let (q, k, v, p) = attn_inputs(&mut r, (24, 4, 256), ctx, nq, ctx + nq, win, causal);
        let what = format!("d=256 ctx={ctx} win={win:?} nq={nq} causal={causal}");
        let (oc, qg, kg, vg) = attn_reference(&g, &cpu, &q, &k, &v, &p);
        let run = |c: AttnKernel, fast: bool| {
            g.set_attn_kernel(c).unwrap();
            let mut og = poisoned(&g, oc.len());
            if fast {
                g.attention_fast(&qg, &kg, &vg, &p, &mut og).unwrap();
            } else {
                g.attention(&qg, &kg, &vg, &p, &mut og).unwrap();
            }
            g.download(&og).unwrap()
        };
        let auto = run(AttnKernel::Auto, false);
        report(&format!("{what} auto"), &auto, &oc, 2e-5);
        for c in tc2 {
            let o = run(c, false);
            assert_same_bits(&format!("{what}: {c:?} vs auto"), &o, &auto);
        }
        let simt = run(AttnKernel::Simt, false);
        report(&format!("{what} simt"), &simt, &oc, 2e-5);
        assert!(
            simt != auto,
            "{what}: the SIMT kernel gave the tensor-core kernel's bits (did it run at all?)"
        );
        for c in simt_like {
            assert_same_bits(&format!("{what}: {c:?} vs simt"), &run(c, false), &simt);
        }
        let fast = run(AttnKernel::Auto, true);
        report(&format!("{what} fast"), &fast, &oc, 4e-3);
        g.set_attn_kernel(AttnKernel::Auto).unwrap();
        if causal && nq > 1 {
            assert_rows_alone_equal(
                &g,
                &q,
                &kg,
                &vg,
                &p,
                &auto,
                Op::Exact,
                &format!("{what} exact"),
            );
            assert_rows_alone_equal(
                &g,
                &q,
                &kg,
                &vg,
                &p,
                &fast,
                Op::Fast,
                &format!("{what} fast"),
            );
        }
    }
    eprintln!("attention at head dim 256: the tensor-core kernel by default, matching the CPU, decode == verify; row warps and stages change no bit");
}

/// Attention captured in a CUDA graph replays correctly (split kernel + ordered combine, with
/// 3 / 5 / 9 / 33 splits, the combine's prefetched and batched partials): each replay (new
/// queries) gives the bits of an eager call on the same inputs, and matches the CPU.
#[test]
fn attention_graph_replays() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(g) = private_gpu("attention_graph_replays") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("attention_graph_replays");
    for n_kv in [528usize, 1040, 2064, 8208] {
        let p = AttnParams {
            n_q: 16,
            n_kv,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            q_pos0: n_kv - 16,
            kv_pos0: 0,
            causal: true,
            window: None,
            scale: 128f32.powf(-0.5),
        };
        let nq = p.n_q * p.n_heads * p.head_dim;
        let k = rand_vec(&mut r, n_kv * 8 * 128, 1.5);
        let v = rand_vec(&mut r, n_kv * 8 * 128, 1.0);
        let (kg, vg) = (g.upload(&k).unwrap(), g.upload(&v).unwrap());
        let mut qg = g.upload(&rand_vec(&mut r, nq, 1.5)).unwrap();
        let mut og = poisoned(&g, nq);
        g.attention(&qg, &kg, &vg, &p, &mut og).expect("eager");
        g.synchronize().unwrap();
        let st = g.stream().clone();
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .expect("capture");
        let res = g
            .fill(&mut og, f32::NAN)
            .and_then(|_| g.attention(&qg, &kg, &vg, &p, &mut og));
        let graph = st
            .end_capture(CUgraphInstantiate_flags(0))
            .expect("end capture")
            .expect("graph");
        res.expect("captured ops");
        for rep in 0..3 {
            let q = rand_vec(&mut r, nq, 1.5);
            st.memcpy_htod(&q, qg.slice_mut()).expect("q");
            graph.launch().expect("replay");
            g.synchronize().unwrap();
            let got = g.download(&og).unwrap();
            let mut oe = poisoned(&g, nq);
            g.attention(&qg, &kg, &vg, &p, &mut oe).expect("eager");
            assert_same_bits(
                &format!("n_kv {n_kv}: graph replay {rep} vs eager"),
                &got,
                &g.download(&oe).unwrap(),
            );
            let mut oc = vec![0.0; nq];
            cpu.attention(&q, &k, &v, &p, &mut oc).unwrap();
            report(
                &format!("attention graph replay {rep} n_kv {n_kv}"),
                &got,
                &oc,
                2e-5,
            );
        }
    }
    eprintln!("attention: graph replays == eager bit for bit, match the CPU");
}

/// The CPU's attention of `q` / `k` / `v` under `p` (the reference), and the three operands
/// uploaded to `g`.
fn attn_reference(
    g: &dflash_cuda_kernels::Cuda,
    cpu: &Cpu,
    q: &Vec<f32>,
    k: &Vec<f32>,
    v: &Vec<f32>,
    p: &AttnParams,
) -> (
    Vec<f32>,
    dflash_cuda_kernels::CudaBuf,
    dflash_cuda_kernels::CudaBuf,
    dflash_cuda_kernels::CudaBuf,
) {
    let mut oc = vec![0.0; q.len()];
    cpu.attention(q, k, v, p, &mut oc).unwrap();
    let up = |x: &[f32]| g.upload(x).unwrap();
    (oc, up(q), up(k), up(v))
}

/// A drafter-shaped attention call (32 / 8 heads of `hd`, `nq` block queries after `ctx`
/// context keys) with fresh random q (n_q x heads), K and V (n_kv = ctx + nq rows).
fn drafter_attn_inputs(
    r: &mut rand::rngs::StdRng,
    ctx: usize,
    hd: usize,
    win: Option<usize>,
    causal: bool,
    nq: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, AttnParams) {
    attn_inputs(r, (32, 8, hd), ctx, nq, ctx + nq, win, causal)
}

/// Random q (`nq` rows from position `ctx`), K / V (`cap` keys from position 0) and the
/// parameters of an attention with `(heads, kv heads, head dim)`.
fn attn_inputs(
    r: &mut rand::rngs::StdRng,
    (h, hkv, hd): (usize, usize, usize),
    ctx: usize,
    nq: usize,
    cap: usize,
    win: Option<usize>,
    causal: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, AttnParams) {
    let q = rand_vec(r, nq * h * hd, 1.5);
    let k = rand_vec(r, cap * hkv * hd, 1.5);
    let v = rand_vec(r, cap * hkv * hd, 1.0);
    let p = AttnParams {
        n_q: nq,
        n_kv: cap,
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: hd,
        q_pos0: ctx,
        kv_pos0: 0,
        causal,
        window: win,
        scale: (hd as f32).powf(-0.5),
    };
    (q, k, v, p)
}

/// `attention_fast` (the drafter's reduced-precision op: for head dims 32 / 64 / 128 the f16
/// tensor-core kernel over non-causal spans of more than 2048 keys, else and with
/// `set_attn_fast_f16(false)` the 1xTF32 one; the exact op for other head dims)
/// against the CPU within the f16 / TF32 bound, not the bits of the exact op where a reduced
/// kernel runs (so it is the kernel measured), the exact op's bits where it does not, the two
/// reduced kernels not each other's bits, and rows deterministic (a row alone == the row of the
/// block; causal decode == verify).
#[test]
fn attention_fast_against_cpu_and_per_row() {
    // A private backend: the f16 / 1xTF32 choice is per backend.
    let Some(g) = private_gpu("attention_fast_against_cpu_and_per_row") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_fast_against_cpu_and_per_row");
    // (context, head dim, window, causal)
    for &(ctx, hd, win, causal) in &[
        (512usize, 128usize, None, false),
        (8192, 128, None, false),
        (8192, 128, Some(2048usize), false),
        (2000, 64, None, false),
        (4000, 64, None, false),
        (300, 32, None, false),
        (3000, 32, None, false),
        (4000, 128, None, true),
        (700, 48, None, false),
    ] {
        let (q, k, v, p) = drafter_attn_inputs(&mut r, ctx, hd, win, causal, 16);
        let (oc, qg, kg, vg) = attn_reference(g, &cpu, &q, &k, &v, &p);
        let mut exact = poisoned(g, oc.len());
        g.attention(&qg, &kg, &vg, &p, &mut exact).unwrap();
        let exact = g.download(&exact).unwrap();
        let mut outs = Vec::new();
        for f16 in [true, false] {
            g.set_attn_fast_f16(f16);
            let mut fast = poisoned(g, oc.len());
            g.attention_fast(&qg, &kg, &vg, &p, &mut fast).unwrap();
            let fast = g.download(&fast).unwrap();
            let what = format!(
                "attention_fast ({}) ctx={ctx} d={hd} win={win:?} causal={causal}",
                if f16 { "f16" } else { "1xTF32" }
            );
            // Operands rounded to f16 (relative 2^-11 each) or truncated to tf32 (2^-10):
            // scores off by ~1e-3 of their size, outputs by ~1e-3 of the largest value.
            report(&what, &fast, &oc, 4e-3);
            let differs = fast
                .iter()
                .zip(&exact)
                .any(|(a, b)| a.to_bits() != b.to_bits());
            if matches!(hd, 32 | 64 | 128) {
                assert!(
                    differs,
                    "{what}: the same bits as the exact op (the reduced kernel did not run)"
                );
            } else {
                assert_same_bits(&format!("{what} (exact kernel)"), &fast, &exact);
            }
            assert_rows_alone_equal(g, &q, &kg, &vg, &p, &fast, Op::Fast, &what);
            outs.push(fast);
        }
        g.set_attn_fast_f16(true);
        let span = win.map_or(p.n_kv, |w| w.min(p.n_kv));
        if matches!(hd, 32 | 64 | 128) && !causal && span > 2048 {
            assert!(
                outs[0]
                    .iter()
                    .zip(&outs[1])
                    .any(|(a, b)| a.to_bits() != b.to_bits()),
                "attention_fast ctx={ctx} d={hd}: f16 and 1xTF32 gave the same bits"
            );
        }
    }
    eprintln!("attention_fast (f16 and 1xTF32): within bound of the CPU, rows deterministic");
}

/// `f16_pack` / `f16_unpack` (the f16 KV cache's codec) against the CPU bit for bit, on values
/// that round up, down and to even, saturate, underflow to subnormals and zero, and NaN; at an
/// offset into the destination.
#[test]
fn f16_pack_unpack_bit_for_bit() {
    let Some(g) = gpu("f16_pack_unpack_bit_for_bit") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("f16_pack_unpack_bit_for_bit");
    let mut x = rand_vec(&mut r, 4094, 3.0);
    let special = [
        65504.0f32,
        65519.0,
        65520.0,
        1e9,
        -1e9,
        -65520.0,
        6.0e-8,
        3.0e-8,
        2.9e-8,
        1.0e-9,
        -6.1e-5,
        0.0,
        -0.0,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        f32::NAN,
    ];
    x.extend_from_slice(&special);
    let n = x.len();
    let h0 = 6;
    let mut want = vec![0.0f32; (h0 + n) / 2];
    cpu.f16_pack(&x, &mut want, h0, n).unwrap();
    // The CPU's packing is the documented rounding: f16_bits of each value.
    for (i, &v) in x.iter().enumerate() {
        let slot = want[(h0 + i) / 2].to_bits();
        let half = if (h0 + i) % 2 == 0 {
            slot & 0xffff
        } else {
            slot >> 16
        } as u16;
        let f = dflash_backend::f16_bits(v);
        let is_nan = |b: u16| b & 0x7c00 == 0x7c00 && b & 0x3ff != 0;
        assert!(
            half == f || (is_nan(half) && is_nan(f)),
            "{v}: {half:#x} vs {f:#x}"
        );
    }
    let xg = g.upload(&x).unwrap();
    let mut got = poisoned(g, (h0 + n) / 2);
    g.fill(&mut got, 0.0).unwrap();
    g.f16_pack(&xg, &mut got, h0, n).unwrap();
    let got = g.download(&got).unwrap();
    let nan16 = |b: u32| b & 0x7c00 == 0x7c00 && b & 0x3ff != 0;
    for (i, (a, b)) in got.iter().zip(&want).enumerate().skip(h0 / 2) {
        let (a, b) = (a.to_bits(), b.to_bits());
        let same = |a: u32, b: u32| a == b || (nan16(a) && nan16(b));
        assert!(
            same(a & 0xffff, b & 0xffff) && same(a >> 16, b >> 16),
            "f16_pack slot {i}: {a:#010x} vs the CPU's {b:#010x}"
        );
    }
    // Unpacking is exact: the f16 values as f32.
    let packed = g.upload(&want).unwrap();
    let mut un = poisoned(g, n);
    g.f16_unpack(&packed, h0, n, &mut un).unwrap();
    let un = g.download(&un).unwrap();
    let mut un_cpu = vec![0.0f32; n];
    cpu.f16_unpack(&want, h0, n, &mut un_cpu).unwrap();
    for (i, (a, b)) in un.iter().zip(&un_cpu).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "f16_unpack {i}: {a} vs the CPU's {b}"
        );
    }
    assert!(g.f16_pack(&xg, &mut g.zeros(n).unwrap(), 1, 2).is_err());
    eprintln!("EXACT f16_pack / f16_unpack == the CPU ({n} values)");
}

/// An f16-cache attention case: the CPU's exact attention over the cache's f16 values (`oc`,
/// from `kr` / `vr`, the K / V rounded to f16), q and the f32 K / V on the device, their f16
/// cache (`f16_pack`), and `attention_fast_kv16`'s output over it (`o16`, written over a
/// poisoned buffer).
struct Kv16Case {
    oc: Vec<f32>,
    kr: Vec<f32>,
    vr: Vec<f32>,
    qg: dflash_cuda_kernels::CudaBuf,
    kg: dflash_cuda_kernels::CudaBuf,
    vg: dflash_cuda_kernels::CudaBuf,
    k16: dflash_cuda_kernels::CudaBuf,
    v16: dflash_cuda_kernels::CudaBuf,
    o16: Vec<f32>,
}

fn kv16_case(
    g: &dflash_cuda_kernels::Cuda,
    cpu: &Cpu,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    p: &AttnParams,
) -> Kv16Case {
    let round = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .map(|&v| half::f16::from_bits(dflash_backend::f16_bits(v)).to_f32())
            .collect()
    };
    let (kr, vr) = (round(k), round(v));
    let mut oc = vec![0.0; q.len()];
    cpu.attention(&q.to_vec(), &kr, &vr, p, &mut oc).unwrap();
    let n = p.n_kv * p.n_kv_heads * p.head_dim;
    let (qg, kg, vg) = (
        g.upload(q).unwrap(),
        g.upload(k).unwrap(),
        g.upload(v).unwrap(),
    );
    let (mut k16, mut v16) = (g.zeros(n / 2).unwrap(), g.zeros(n / 2).unwrap());
    g.f16_pack(&kg, &mut k16, 0, n).unwrap();
    g.f16_pack(&vg, &mut v16, 0, n).unwrap();
    let mut o16 = poisoned(g, oc.len());
    g.attention_fast_kv16(&qg, &k16, &v16, p, &mut o16).unwrap();
    let o16 = g.download(&o16).unwrap();
    Kv16Case {
        oc,
        kr,
        vr,
        qg,
        kg,
        vg,
        k16,
        v16,
        o16,
    }
}

/// `attention_fast_kv16` over an f16 cache: against the CPU's exact attention over the same
/// f16 values within the f16 bound (Q and P still rounded to f16), rows deterministic, the
/// bits of `attention_fast` over the f32 cache where that runs the f16 kernel (non-causal
/// spans over 2048 keys: the same tiles, the same arithmetic), and the unpacking path for a
/// head dim without a kernel (48) equal to `attention_fast` over the unpacked cache.
#[test]
fn attention_fast_kv16_against_cpu_and_the_f32_cache() {
    // A private backend: the FA choice it sets is per backend, and the shared one serves the
    // other tests of this binary at the same time (a toggle there changed the kernel under
    // another test's per-row comparison).
    let Some(g) = private_gpu("attention_fast_kv16_against_cpu_and_the_f32_cache") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_fast_kv16_against_cpu_and_the_f32_cache");
    // (context, head dim, window, causal, queries)
    for &(ctx, hd, win, causal, nq) in &[
        (240usize, 128usize, None, false, 16usize),
        (512, 128, None, false, 16),
        (1024, 128, None, false, 16),
        (8192, 128, None, false, 16),
        (8192, 128, Some(2048usize), false, 16),
        (3000, 64, None, false, 16),
        (300, 32, None, false, 16),
        (3000, 32, None, false, 9),
        (4000, 128, None, true, 16),
        (600, 64, Some(256), true, 5),
        (700, 48, None, false, 16),
        (5000, 128, None, false, 1),
    ] {
        let (q, k, v, p) = drafter_attn_inputs(&mut r, ctx, hd, win, causal, nq);
        let cap = p.n_kv;
        let Kv16Case {
            oc,
            kr,
            vr,
            qg,
            kg,
            vg,
            k16,
            v16,
            o16,
        } = kv16_case(g, &cpu, &q, &k, &v, &p);
        let what =
            format!("attention_fast_kv16 ctx={ctx} d={hd} win={win:?} causal={causal} nq={nq}");
        // Q and P rounded to f16 (relative 2^-11 each), f32 accumulation.
        report(&what, &o16, &oc, 4e-3);
        if nq > 1 {
            assert_rows_alone_equal(g, &q, &k16, &v16, &p, &o16, Op::FastKv16, &what);
        }
        let span = win.map_or(cap, |w| w.min(cap));
        if matches!(hd, 32 | 64 | 128) && !causal && span > 2048 {
            // These spans run the FA kernel by default; the 4-key-warp kernel (FA off) has the
            // bits of the f16 kernel over the f32 cache.
            g.set_attn_fa(AttnFa {
                long: false,
                ..AttnFa::default()
            })
            .unwrap();
            let mut ok = poisoned(g, oc.len());
            g.attention_fast_kv16(&qg, &k16, &v16, &p, &mut ok).unwrap();
            let mut of = poisoned(g, oc.len());
            g.attention_fast(&qg, &kg, &vg, &p, &mut of).unwrap();
            g.set_attn_fa(AttnFa::default()).unwrap();
            let ok = g.download(&ok).unwrap();
            report(&format!("{what}, 4 key warps"), &ok, &oc, 4e-3);
            assert_same_bits(
                &format!(
                    "{what}, 4 key warps, vs attention_fast over the f32 cache (the f16 kernel)"
                ),
                &ok,
                &g.download(&of).unwrap(),
            );
        }
        if hd == 48 {
            let (kr, vr) = (g.upload(&kr).unwrap(), g.upload(&vr).unwrap());
            let mut of = poisoned(g, oc.len());
            g.attention_fast(&qg, &kr, &vr, &p, &mut of).unwrap();
            assert_same_bits(
                &format!("{what} vs attention_fast over the unpacked cache"),
                &o16,
                &g.download(&of).unwrap(),
            );
        }
    }
    eprintln!("attention_fast_kv16: within the f16 bound of the CPU, rows deterministic, the f32 cache's f16-kernel bits");
}

/// The FlashAttention-2-style f16-cache kernel (`AttnFa`) on every call, not only the long
/// non-causal spans it runs by default: masks (causal, windows, ragged last chunks), head dims
/// 32 / 64 / 128, 1-16 queries, GQA groups, stages and row warps; against the CPU's exact
/// attention over the same f16 values within the f16 bound, rows deterministic.
#[test]
fn attention_fa_kernel_on_every_call_against_cpu() {
    // A private backend: the FA choice it sets is per backend, and the shared one serves the
    // other tests of this binary at the same time (a toggle there changed the kernel under
    // another test's per-row comparison).
    let Some(g) = private_gpu("attention_fa_kernel_on_every_call_against_cpu") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_fa_kernel_on_every_call_against_cpu");
    // wgmma: its warpgroup-MMA twin where the device has it (compute capability 9.0, head dim
    // 128), then the mma.sync kernel everywhere.
    for wgmma in [true, false] {
        g.set_attn_fa(AttnFa {
            all: true,
            wgmma,
            ..AttnFa::default()
        })
        .unwrap();
        // (context, head dim, window, causal, queries, stages (0 = automatic), row warps)
        for &(ctx, hd, win, causal, nq, st, rw) in &[
            (240usize, 128usize, None, false, 16usize, 0usize, 0usize),
            (528, 128, None, false, 16, 0, 0),
            (528, 128, None, false, 16, 1, 4),
            (1000, 128, None, false, 16, 2, 1),
            (8208, 128, None, false, 16, 0, 0),
            (8208, 128, None, false, 16, 3, 2),
            (8192, 128, Some(2048usize), false, 16, 0, 0),
            (3000, 64, None, false, 16, 0, 0),
            (300, 32, None, false, 16, 0, 0),
            (3000, 32, None, false, 9, 0, 0),
            (4000, 128, None, true, 16, 0, 0),
            (600, 64, Some(256), true, 5, 0, 0),
            (5000, 128, None, false, 1, 0, 0),
            (77, 128, None, false, 16, 0, 0),
        ] {
            g.set_attn_kernel(AttnKernel::Tc {
                key_warps: 4,
                row_warps: rw,
                ffma_pv: false,
                stages: st,
            })
            .unwrap();
            let (q, k, v, p) = drafter_attn_inputs(&mut r, ctx, hd, win, causal, nq);
            let Kv16Case {
                oc, k16, v16, o16, ..
            } = kv16_case(g, &cpu, &q, &k, &v, &p);
            let what = format!(
            "FA attention_fast_kv16 ctx={ctx} d={hd} win={win:?} causal={causal} nq={nq} stages={st} row_warps={rw} wgmma={wgmma}"
        );
            report(&what, &o16, &oc, 4e-3);
            if nq > 1 {
                assert_rows_alone_equal(g, &q, &k16, &v16, &p, &o16, Op::FastKv16, &what);
            }
        }
    }
    g.set_attn_kernel(AttnKernel::Auto).unwrap();
    g.set_attn_fa(AttnFa::default()).unwrap();
    eprintln!("FA kernel on every call: within the f16 bound of the CPU, rows deterministic");
}

/// The Markov chain on the device captured in a CUDA graph and replayed (the previous token
/// read and written on the device by every step): every replay gives the CPU chain's tokens
/// and the eager chain's logits bit for bit.
#[test]
fn markov_chain_graph_replays() {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let Some(g) = private_gpu("markov_chain_graph_replays") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("markov_chain_graph_replays");
    let (vocab, rank, n) = (20_000usize, 256usize, 15usize);
    for fmt in [WeightFormat::Q8_0A8, WeightFormat::Bf16, WeightFormat::Q8_0] {
        let h1 = HostWeight::from_f32("w1", vocab, rank, &rand_vec(&mut r, vocab * rank, 1.0), fmt)
            .unwrap();
        let h2 = HostWeight::from_f32("w2", vocab, rank, &rand_vec(&mut r, vocab * rank, 0.2), fmt)
            .unwrap();
        let (c1, c2) = (
            cpu.upload_weight(&h1).unwrap(),
            cpu.upload_weight(&h2).unwrap(),
        );
        let (g1, g2) = (g.upload_weight(&h1).unwrap(), g.upload_weight(&h2).unwrap());
        let st = g.stream().clone();
        let mut lg = g.zeros(n * vocab).unwrap();
        let mut prev = st.alloc_zeros::<u32>(1).unwrap();
        let mut toks = st.alloc_zeros::<u32>(n).unwrap();
        // Eager once (allocates the scratch), then capture.
        g.markov_chain_dev(&mut lg, n, vocab, &mut prev, &mut toks, &g1, &g2)
            .expect("eager");
        g.synchronize().unwrap();
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .expect("capture");
        let res = g.markov_chain_dev(&mut lg, n, vocab, &mut prev, &mut toks, &g1, &g2);
        let graph = st
            .end_capture(CUgraphInstantiate_flags(0))
            .expect("end capture")
            .expect("graph");
        res.expect("captured chain");
        for rep in 0..3 {
            let logits = rand_vec(&mut r, n * vocab, 4.0);
            let first = r.random_range(0..vocab as u32);
            st.memcpy_htod(&logits, lg.slice_mut()).expect("logits");
            st.memcpy_htod(&[first], &mut prev).expect("prev");
            graph.launch().expect("replay");
            g.synchronize().unwrap();
            let got_toks = st.clone_dtoh(&toks).expect("toks");
            let got_logits = g.download(&lg).unwrap();
            let mut lc = logits.clone();
            let want = cpu
                .markov_chain(&mut lc, n, vocab, first, &c1, &c2)
                .unwrap();
            assert_eq!(
                got_toks, want,
                "{fmt:?} replay {rep}: tokens vs the CPU chain"
            );
            assert_eq!(
                st.clone_dtoh(&prev).expect("prev")[0],
                want[n - 1],
                "{fmt:?} replay {rep}: prev ends as the last draft"
            );
            // The eager chain from the same start: the same logits bit for bit.
            let mut le = g.upload(&logits).unwrap();
            st.memcpy_htod(&[first], &mut prev).expect("prev");
            g.markov_chain_dev(&mut le, n, vocab, &mut prev, &mut toks, &g1, &g2)
                .expect("eager");
            assert_same_bits(
                &format!("{fmt:?} replay {rep}: graph vs eager logits"),
                &got_logits,
                &g.download(&le).unwrap(),
            );
            report(
                &format!("markov_chain graph replay {rep} {fmt:?} (tokens identical)"),
                &got_logits,
                &lc,
                2e-5,
            );
        }
    }
}

#[test]
fn upload_refuses_a_weight_whose_shape_does_not_match_its_values() {
    // A HostWeight whose public fields were edited after construction: every format is
    // refused with an error naming the tensor, before any repack reads past its values.
    let Some(g) = gpu("upload_refuses_a_weight_whose_shape_does_not_match_its_values") else {
        return;
    };
    for fmt in FORMATS
        .into_iter()
        .chain([WeightFormat::Q8_0A8, WeightFormat::Q4_0A8])
    {
        let mut hw = HostWeight::from_f32("forged", 2, 64, &[0.5; 128], fmt).expect("encode");
        hw.rows = 3;
        match g.upload_weight(&hw) {
            Err(BackendError::Weight(m)) => {
                assert!(m.contains("forged") && m.contains("3x64"), "{fmt:?}: {m}")
            }
            Err(e) => panic!("{fmt:?}: the wrong error: {e}"),
            Ok(_) => panic!("{fmt:?}: a 3x64 weight of 128 values was accepted"),
        }
    }
}

/// One causal attention case under `g`'s causal split tables: the exact, fast and f16-cache
/// ops against the CPU, decode == verify bit for bit (each row alone over the keys up to its
/// position), and `attention_q8`'s bits equal to the attention's. Returns the exact output.
fn check_causal_case(
    g: &dflash_cuda_kernels::Cuda,
    cpu: &Cpu,
    r: &mut rand::rngs::StdRng,
    (ctx, hd, win, nq): (usize, usize, Option<usize>, usize),
) -> Vec<f32> {
    let (q, k, v, p) = drafter_attn_inputs(r, ctx, hd, win, true, nq);
    let what = format!("causal splits ctx={ctx} d={hd} win={win:?} nq={nq}");
    let (oc, qg, kg, vg) = attn_reference(g, cpu, &q, &k, &v, &p);
    let mut oe = poisoned(g, oc.len());
    g.attention(&qg, &kg, &vg, &p, &mut oe).unwrap();
    let oe = g.download(&oe).unwrap();
    report(&format!("{what} exact"), &oe, &oc, 2e-5);
    assert_rows_alone_equal(
        g,
        &q,
        &kg,
        &vg,
        &p,
        &oe,
        Op::Exact,
        &format!("{what} exact"),
    );
    let mut of = poisoned(g, oc.len());
    g.attention_fast(&qg, &kg, &vg, &p, &mut of).unwrap();
    let of = g.download(&of).unwrap();
    report(&format!("{what} fast"), &of, &oc, 4e-3);
    assert_rows_alone_equal(g, &q, &kg, &vg, &p, &of, Op::Fast, &format!("{what} fast"));
    if hd != 256 {
        let c = kv16_case(g, cpu, &q, &k, &v, &p);
        report(&format!("{what} f16 cache"), &c.o16, &c.oc, 4e-3);
        assert_rows_alone_equal(
            g,
            &q,
            &c.k16,
            &c.v16,
            &p,
            &c.o16,
            Op::FastKv16,
            &format!("{what} f16 cache"),
        );
    }
    if hd % 32 == 0 && hd <= 256 {
        let mut o8 = poisoned(g, oc.len());
        g.attention_q8(&qg, &kg, &vg, &p, false, KvStorage::F32, &mut o8)
            .unwrap();
        assert_same_bits(
            &format!("{what}: attention_q8's output vs attention"),
            &g.download(&o8).unwrap(),
            &oe,
        );
    }
    oe
}

/// Causal rows taking the split of the keys they see (`set_attn_causal_splits`; a verify
/// whose rows straddle a threshold runs as one call per split): the exact, fast and f16-cache
/// ops against the CPU, and decode == verify bit for bit (queries 0 / 7 / 15 alone over the
/// keys up to their positions), for verifies below, across and above thresholds, windows,
/// head dim 256 (its 2-key-warp tensor-core kernel); `attention_q8` across a threshold (no combine-written
/// activation there: its quantizer) gives the attention's bits. Bad tables are refused.
#[test]
fn attention_causal_splits() {
    // A private backend: the knob changes every causal call's bits.
    let Some(g) = private_gpu("attention_causal_splits") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_causal_splits");
    for bad in [
        vec![],
        vec![(64usize, 256usize)],
        vec![(0, 256), (0, 512)],
        vec![(0, 100)],
        vec![(0, 256), (1000, 512)],
        vec![(0, 8192)],
    ] {
        assert!(g.set_attn_causal_splits(&bad).is_err(), "{bad:?} accepted");
    }
    g.set_attn_causal_splits(&[(0, 128), (512, 256), (1024, 512), (2048, 1024)])
        .expect("table");
    for &(ctx, hd, win, nq) in &[
        (300usize, 128usize, None, 16usize),
        (500, 128, None, 16),
        (1020, 128, None, 16),
        (1030, 64, None, 16),
        (2040, 128, None, 16),
        (5000, 128, None, 16),
        (5000, 128, Some(700usize), 16),
        (5000, 64, Some(3000), 9),
        (1015, 256, None, 16),
    ] {
        check_causal_case(g, &cpu, &mut r, (ctx, hd, win, nq));
    }
    eprintln!("attention with causal splits by the keys a row sees: exact / fast / f16 cache match the CPU; decode == verify bit for bit");
}

/// The default causal split tables, one per head dim (64 keys per split at short contexts,
/// 128 up to 2048 keys at head dims up to 128 and up to 8192 above): verifies whose rows
/// straddle each threshold against the CPU, decode == verify bit for bit, and the default
/// gives other bits than 256-key splits at short contexts (the tables are in use) and its own
/// bits again once restored.
#[test]
fn attention_causal_default_tables() {
    // A private backend: the test sets the knob.
    let Some(g) = private_gpu("attention_causal_default_tables") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_causal_default_tables");
    for case in [
        (300usize, 128usize, None, 16usize),
        (1015, 128, None, 16),
        (2040, 128, None, 16),
        (300, 256, None, 16),
        (2040, 256, None, 16),
        (8185, 256, None, 16),
        (3000, 256, Some(1500), 16),
    ] {
        check_causal_case(g, &cpu, &mut r, case);
    }
    // Short contexts: 64-key splits by default, against 256-key splits.
    for hd in [128usize, 256] {
        let (q, k, v, p) = drafter_attn_inputs(&mut r, 500, hd, None, true, 16);
        let (qg, kg, vg) = (
            g.upload(&q).unwrap(),
            g.upload(&k).unwrap(),
            g.upload(&v).unwrap(),
        );
        let run = || {
            let mut o = poisoned(g, q.len());
            g.attention(&qg, &kg, &vg, &p, &mut o).unwrap();
            g.download(&o).unwrap()
        };
        let default = run();
        g.set_attn_causal_splits(&[(0, 256), (16384, 512), (32768, 1024), (65536, 2048)])
            .expect("table");
        let old = run();
        g.set_attn_causal_splits_default();
        assert_same_bits(&format!("d={hd}: the default restored"), &run(), &default);
        assert!(
            default
                .iter()
                .zip(&old)
                .any(|(a, b)| a.to_bits() != b.to_bits()),
            "d={hd}: the default table gave the bits of 256-key splits at 500 keys"
        );
    }
    eprintln!("attention under the default causal split tables: exact / fast / f16 cache match the CPU; decode == verify bit for bit");
}

/// A prefill's causal attention (more than 16 query rows) under `set_attn_prefill_split`:
/// one split of the whole span, or 1024 keys, for a prompt from position 0 and a chunk after
/// a context, windows too; against the CPU (exact, fast, f16 cache), and 16-row calls keep the
/// splits of the keys they see (the same bits with the knob on and off).
#[test]
fn attention_prefill_split_against_cpu() {
    // A private backend: the knob changes the prefill's bits.
    let Some(g) = private_gpu("attention_prefill_split_against_cpu") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_prefill_split_against_cpu");
    assert!(g.set_attn_prefill_split(100).is_err(), "100 keys accepted");
    for &(ctx, hd, win, nq) in &[
        (0usize, 128usize, None, 600usize),
        (700, 128, None, 300),
        (0, 64, Some(200usize), 500),
        (300, 128, None, 16),
    ] {
        let (q, k, v, p) = drafter_attn_inputs(&mut r, ctx, hd, win, true, nq);
        let (oc, qg, kg, vg) = attn_reference(g, &cpu, &q, &k, &v, &p);
        let run = |split: usize| {
            g.set_attn_prefill_split(split).expect("split");
            let mut oe = poisoned(g, oc.len());
            g.attention(&qg, &kg, &vg, &p, &mut oe).unwrap();
            let mut of = poisoned(g, oc.len());
            g.attention_fast(&qg, &kg, &vg, &p, &mut of).unwrap();
            let c = kv16_case(g, &cpu, &q, &k, &v, &p);
            (
                g.download(&oe).unwrap(),
                g.download(&of).unwrap(),
                c.o16,
                c.oc,
            )
        };
        let base = run(0);
        for split in [1024usize, 1 << 20] {
            let what = format!("prefill split {split} ctx={ctx} d={hd} win={win:?} nq={nq}");
            let (oe, of, o16, oc16) = run(split);
            report(&format!("{what} exact"), &oe, &oc, 2e-5);
            report(&format!("{what} fast"), &of, &oc, 4e-3);
            report(&format!("{what} f16 cache"), &o16, &oc16, 4e-3);
            if nq <= 16 {
                assert_same_bits(&format!("{what}: a 16-row call"), &oe, &base.0);
            }
        }
    }
    g.set_attn_prefill_split(0).expect("reset");
}

/// A prefill's causal rows through the FlashAttention-2-style kernels
/// (`set_attn_prefill_fa`, the default): `attn_pf_*` over an f32 cache (exact: bf16 hi + lo
/// operands, three products; fast: f16) and the FA kernel over an f16 cache, against the CPU
/// for prompts from position 0 and chunks after a context, windows, GQA groups of 4 and 1,
/// head dims 32 / 64 / 128 and keys past the last row; with the knob off the split kernels of the
/// other calls, within the same bounds and not the same bits (so the kernel measured is the
/// new one); the one-split call writing its rows itself (`set_prefill_producers`) the bits of
/// its partial through the combine; and a row's bits do not depend on the rows beside it (the
/// first rows alone, and the last rows as a chunk at their positions, give the full call's
/// bits).
#[test]
fn attention_prefill_fa_against_cpu() {
    // A private backend: the knob changes the prefill's bits.
    let Some(g) = private_gpu("attention_prefill_fa_against_cpu") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_prefill_fa_against_cpu");
    for &(ctx, nq, h, hkv, hd, win) in &[
        (0usize, 1000usize, 32usize, 8usize, 128usize, None),
        (700, 300, 32, 8, 128, None),
        (0, 517, 16, 16, 128, None),
        (0, 500, 32, 8, 64, Some(200usize)),
        (90, 77, 8, 2, 64, None),
        (40, 300, 8, 2, 32, Some(37)),
    ] {
        // (5 keys past the last row: masked)
        let (q, k, v, p) = attn_inputs(&mut r, (h, hkv, hd), ctx, nq, ctx + nq + 5, win, true);
        let mut oc = vec![0.0; q.len()];
        cpu.attention(&q, &k, &v, &p, &mut oc).unwrap();
        let what = format!("prefill FA ctx={ctx} nq={nq} h={h}/{hkv} d={hd} win={win:?}");
        // (exact, fast, f16 cache) outputs of the rows `rows` of `p` as one call.
        let run = |rows: std::ops::Range<usize>| {
            let w = h * hd;
            let pr = AttnParams {
                n_q: rows.len(),
                q_pos0: ctx + rows.start,
                ..p
            };
            let qr = &q[rows.start * w..rows.end * w];
            let qg = g.upload(qr).unwrap();
            let (kg, vg) = (g.upload(&k).unwrap(), g.upload(&v).unwrap());
            let mut oe = poisoned(g, qr.len());
            g.attention(&qg, &kg, &vg, &pr, &mut oe).unwrap();
            let mut of = poisoned(g, qr.len());
            g.attention_fast(&qg, &kg, &vg, &pr, &mut of).unwrap();
            let c = kv16_case(g, &cpu, qr, &k, &v, &pr);
            (
                g.download(&oe).unwrap(),
                g.download(&of).unwrap(),
                c.o16,
                c.oc,
            )
        };
        g.set_attn_prefill_fa(false);
        let (oe0, of0, o160, oc16) = run(0..nq);
        report(&format!("{what} exact, split kernels"), &oe0, &oc, 2e-5);
        report(&format!("{what} fast, split kernels"), &of0, &oc, 4e-3);
        report(
            &format!("{what} f16 cache, split kernels"),
            &o160,
            &oc16,
            4e-3,
        );
        g.set_attn_prefill_fa(true);
        let (oe, of, o16, _) = run(0..nq);
        report(&format!("{what} exact"), &oe, &oc, 2e-5);
        report(&format!("{what} fast"), &of, &oc, 4e-3);
        report(&format!("{what} f16 cache"), &o16, &oc16, 4e-3);
        assert!(
            oe.iter().zip(&oe0).any(|(a, b)| a.to_bits() != b.to_bits()),
            "{what}: the exact op gave the split kernels' bits"
        );
        // The kernel's one-split call writing its rows itself (the prefill producers: no
        // partial, no combine) against the combine's output: the same bits.
        g.set_prefill_producers(false);
        let (oe1, of1, o161, _) = run(0..nq);
        g.set_prefill_producers(true);
        assert_same_bits(&format!("{what} exact, combine"), &oe, &oe1);
        assert_same_bits(&format!("{what} fast, combine"), &of, &of1);
        assert_same_bits(&format!("{what} f16 cache, combine"), &o16, &o161);
        let w = h * hd;
        for rows in [0..nq / 2 + 3, nq - nq / 3 - 1..nq] {
            let (e, f, o, _) = run(rows.clone());
            let part = rows.start * w..rows.end * w;
            let at = format!("{what}: rows {rows:?} alone");
            assert_same_bits(&format!("{at} exact"), &e, &oe[part.clone()]);
            assert_same_bits(&format!("{at} fast"), &f, &of[part.clone()]);
            assert_same_bits(&format!("{at} f16 cache"), &o, &o16[part]);
        }
    }
    eprintln!(
        "prefill FA kernels: within bound of the CPU, rows independent of the call's other rows"
    );
}

/// A prompt's attention at a head dim without a tensor-core prefill kernel (256: the Qwen3.5
/// / Qwen3.6 full-attention layers; 16 and 96 too) through two cuBLAS products around the
/// masked softmax (`Cuda::set_attn_gemm`, 64+ rows, f32 cache) against the CPU: bf16 hi / lo
/// operands on the tensor cores (every head in one product, the second product in key chunks:
/// automatic, 3 and 2) and f32 products, each in one block of rows and in several, with causal
/// / window / non-causal masks and rows that see no key; a causal prefill under
/// `PrefillPrecision::Fast` (f16 operands) within the fast bound; the SIMT split kernel (the
/// knob off) against the CPU too. The two product modes do not give the same bits (each is
/// the path it names).
#[test]
fn attention_gemm_against_cpu() {
    use dflash_cuda_kernels::{AttnGemm, PrefillPrecision};
    // A private backend: the knobs change the bits.
    let Some(g) = private_gpu("attention_gemm_against_cpu") else {
        return;
    };
    let g = &g;
    let cpu = Cpu::new();
    let mut r = rng("attention_gemm_against_cpu");
    for &(ctx, nq, h, hkv, hd, win, causal, kv0) in &[
        (
            0usize, 300usize, 24usize, 4usize, 256usize, None, true, 0usize,
        ),
        (100, 200, 6, 2, 256, Some(150usize), true, 0),
        (0, 64, 4, 4, 256, None, false, 0),
        (0, 100, 4, 2, 16, None, true, 0),
        (50, 90, 8, 8, 96, Some(40), true, 0),
        // kv positions from 10: the first 10 rows see no key (zeros).
        (0, 70, 6, 3, 256, None, true, 10),
    ] {
        let (q, k, v, mut p) =
            attn_inputs(&mut r, (h, hkv, hd), ctx, nq, ctx + nq + 5, win, causal);
        p.kv_pos0 = kv0;
        let (oc, qg, kg, vg) = attn_reference(g, &cpu, &q, &k, &v, &p);
        let what =
            format!("ctx={ctx} nq={nq} h={h}/{hkv} d={hd} win={win:?} causal={causal} kv0={kv0}");
        let mut outs = Vec::new();
        // (mode, precision, score values per block: one block, then blocks of 7 rows; key
        // chunks, 0 automatic)
        let few = 7 * h * p.n_kv;
        for (mode, prec, scores, chunks) in [
            (
                AttnGemm::Bf16x3,
                PrefillPrecision::Exact,
                32usize << 20,
                0usize,
            ),
            (AttnGemm::Bf16x3, PrefillPrecision::Exact, few, 3),
            (AttnGemm::F32, PrefillPrecision::Exact, 32 << 20, 0),
            (AttnGemm::F32, PrefillPrecision::Exact, few, 0),
            (AttnGemm::Bf16x3, PrefillPrecision::Fast, few, 2),
            (AttnGemm::Off, PrefillPrecision::Exact, 32 << 20, 0),
            (AttnGemm::Fused, PrefillPrecision::Exact, 32 << 20, 0),
            (AttnGemm::Fused, PrefillPrecision::Fast, 32 << 20, 0),
        ] {
            g.set_attn_gemm(mode);
            g.set_attn_gemm_scores(scores);
            g.set_attn_gemm_chunks(chunks);
            g.set_prefill_precision(prec);
            let mut og = poisoned(g, oc.len());
            g.attention(&qg, &kg, &vg, &p, &mut og).unwrap();
            // The fast precision applies to a causal prefill only.
            let f16 = prec == PrefillPrecision::Fast && causal;
            let tol = if f16 { 4e-3 } else { 2e-5 };
            let o = g.download(&og).unwrap();
            report(
                &format!(
                    "attention {mode:?} {prec:?} {what} scores/block {scores} chunks {chunks}"
                ),
                &o,
                &oc,
                tol,
            );
            outs.push(o);
        }
        assert!(
            outs[0]
                .iter()
                .zip(&outs[2])
                .any(|(a, b)| a.to_bits() != b.to_bits()),
            "{what}: the bf16 products gave the f32 products' bits"
        );
        // The fused kernel runs at head dim 256 (another summation order than the products'),
        // elsewhere the products themselves.
        let fused_differs = outs[6]
            .iter()
            .zip(&outs[0])
            .any(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(
            fused_differs,
            hd == 256,
            "{what}: AttnGemm::Fused against the bf16 products"
        );
        // The fused kernel's other shapes: more stages or rows per block give the same bits,
        // another chunk size another order within the tolerance (a shape built only for f16
        // runs the products in the exact op).
        g.set_attn_gemm(AttnGemm::Fused);
        g.set_attn_gemm_scores(32 << 20);
        for (prec, keys, stages, rows, same_as) in [
            (PrefillPrecision::Exact, 32, 3, 64, Some(6)),
            (PrefillPrecision::Fast, 32, 3, 64, Some(7)),
            (PrefillPrecision::Fast, 32, 2, 128, Some(7)),
            (PrefillPrecision::Fast, 64, 2, 64, None),
        ] {
            g.set_prefill_precision(prec);
            g.set_attn_pf2_shape(keys, stages, rows);
            let mut og = poisoned(g, oc.len());
            g.attention(&qg, &kg, &vg, &p, &mut og).unwrap();
            g.set_attn_pf2_shape(0, 0, 0);
            let o = g.download(&og).unwrap();
            let f16 = prec == PrefillPrecision::Fast && causal;
            let label = format!(
                "attention Fused {prec:?} {what} {keys} keys x {stages} stages, {rows} rows"
            );
            report(&label, &o, &oc, if f16 { 4e-3 } else { 2e-5 });
            let built = f16 || (keys, stages, rows) == (32, 3, 64);
            if let Some(i) = same_as.filter(|_| hd == 256 && built) {
                assert!(
                    o.iter()
                        .zip(&outs[i])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{label}: not the default shape's bits"
                );
            }
        }
        g.set_attn_gemm(AttnGemm::default());
        g.set_attn_gemm_scores(32 << 20);
        g.set_attn_gemm_chunks(0);
        g.set_prefill_precision(PrefillPrecision::Exact);
    }
}

/// The backend's memory pool: freed buffers stay reserved for later ones by default (and a
/// reused buffer from `zeros` holds zeros, not what the freed one held), `trim_pool` returns
/// them to the driver, and `set_pool_keep(0)` returns them at each synchronization.
#[test]
fn memory_pool_keeps_reuses_and_trims() {
    let Some(g) = private_gpu("memory_pool_keeps_reuses_and_trims") else {
        return;
    };
    let n = 16 << 20;
    let bytes = (n * 4) as u64;
    let (r0, u0) = g.pool_bytes().expect("pool bytes");
    let sevens = g.upload(&vec![7.0f32; n]).expect("upload");
    g.synchronize().unwrap();
    let (r1, u1) = g.pool_bytes().unwrap();
    assert!(
        u1 >= u0 + bytes && r1 >= u1,
        "in use {u1}, reserved {r1}, buffer {bytes}"
    );
    drop(sevens);
    g.synchronize().unwrap();
    let (r2, u2) = g.pool_bytes().unwrap();
    assert!(
        u2 <= u0 && r2 >= r0 + bytes,
        "freed: in use {u2}, reserved {r2} (kept)"
    );
    let z = g.zeros(n).expect("zeros");
    let (r3, _) = g.pool_bytes().unwrap();
    assert_eq!(r3, r2, "the freed memory was reused, nothing new reserved");
    let v = g.download(&z).unwrap();
    assert!(v.iter().all(|&x| x == 0.0), "zeros over reused memory");
    drop(z);
    g.synchronize().unwrap();
    g.trim_pool(0).expect("trim");
    let (r4, _) = g.pool_bytes().unwrap();
    assert!(r4 < r0 + bytes, "trimmed: reserved {r4}");
    // Scratch: the pool's values as they are, or NaN when poisoned.
    g.set_poison_scratch(true);
    let sc = g.download(&g.scratch(1000).expect("scratch")).unwrap();
    assert!(sc.iter().all(|x| x.is_nan()), "a poisoned scratch buffer");
    g.set_poison_scratch(false);
    g.set_pool_keep(0).expect("keep none");
    let b = g.zeros(n).expect("zeros");
    drop(b);
    g.synchronize().unwrap();
    let (r5, _) = g.pool_bytes().unwrap();
    assert!(
        r5 < r0 + bytes,
        "keep 0: reserved {r5} after a synchronization"
    );
    eprintln!(
        "memory pool: {} MiB kept after the free, reused by zeros, trimmed to {r4} bytes",
        r2 >> 20
    );
}

#[test]
fn kernel_info_reports_every_kernel_once() {
    let Some(g) = gpu("kernel_info_reports_every_kernel_once") else {
        return;
    };
    use dflash_cuda_kernels::registry::Kernel;
    let all = g.kernel_info("").expect("kernel info");
    let kernels: std::collections::HashSet<Kernel> = all.iter().map(|(k, _, _)| *k).collect();
    assert_eq!(kernels.len(), all.len(), "a kernel reported twice");
    // Entry points repeat across modules (matmul_q4 has the a8 kernels' names): the module
    // and the entry point together are unique.
    let keys: std::collections::HashSet<_> =
        all.iter().map(|(k, _, _)| (k.module(), k.name())).collect();
    assert_eq!(
        keys.len(),
        all.len(),
        "two kernels with one module and entry point"
    );
    // Every kernel built for every architecture is there; those of one architecture only
    // where the device has it.
    for k in Kernel::ALL {
        assert!(
            kernels.contains(k) || k.only_for().is_some(),
            "{} missing",
            k.name()
        );
    }
    for &(k, regs, local) in &all {
        assert!(
            (1..=255).contains(&regs) && local >= 0,
            "{}: {regs} registers, {local} local bytes",
            k.name()
        );
    }
    let glu = g.kernel_info("skinny_glu").expect("kernel info");
    let want: Vec<_> = all
        .iter()
        .filter(|(k, _, _)| k.name().contains("skinny_glu"))
        .copied()
        .collect();
    assert!(!glu.is_empty());
    assert_eq!(
        glu, want,
        "the filter picks the same entries, in the same order"
    );
}

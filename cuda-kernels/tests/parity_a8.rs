//! `WeightFormat::Q8_0A8` and `WeightFormat::Q4_0A8` (every test runs both; Q4_0A8's contract
//! is Q8_0A8's over the widened q4_0 codes) on CUDA (q8_0 weights x activations quantized to q8_0 on the int8
//! tensor cores), on fresh random inputs each run (seed printed), outputs poisoned (NaN):
//! * the activation quantizer byte for byte against `dflash_quant::quantize_q8_0`;
//! * the matmul BIT FOR BIT against a host transcription of the contract (per chunk of 32
//!   blocks `acc_c = fma(isum_b as f32, d_w * d_x, acc_c)` over the chunk's blocks in order,
//!   then `out = acc_0 + acc_1 + ...` in chunk order), under every kernel choice, in CUDA
//!   graph replays too;
//! * the matmul bit for bit against the CPU backend's Q8_0A8;
//! * per-row determinism (rows of a 16-row call == the same rows alone), bit for bit;
//! * `gather_rows` of a Q8_0A8 (Q4_0A8) table == q8_0 (q4_0) dequantization, exactly;
//! * one `matmul_many` of Q8_0A8 and Q4_0A8 matrices == their separate matmuls.

mod common;

use common::{gpu, poisoned, rand_vec, rng};
use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostData, HostWeight, TailScratch, WeightFormat, A8_CHUNK_BLOCKS};
use dflash_cuda_kernels::{Cuda, CudaBuf};
use dflash_quant::{quantize_q8_0, BlockQ8_0};
use rand::rngs::StdRng;
use rand::Rng;

/// x with per-block magnitudes spread over many octaves, some all-zero blocks, some blocks
/// of tiny values (subnormal scales) and some with exact .5 products (rounding ties).
fn spread_x(r: &mut StdRng, rows: usize, k: usize) -> Vec<f32> {
    let mut x = rand_vec(r, rows * k, 1.0);
    for blk in x.chunks_exact_mut(32) {
        match r.random_range(0..10u32) {
            0 => blk.iter_mut().for_each(|v| *v = 0.0),
            1 => blk.iter_mut().for_each(|v| *v *= 1e-40),
            2 => {
                // amax 127 -> d = 1, id = 1: halves round away from zero.
                for (i, v) in blk.iter_mut().enumerate() {
                    *v = (i as f32 - 16.0) + 0.5;
                }
                blk[0] = 127.0;
            }
            3 => {
                let s = 2f32.powi(r.random_range(-20..20));
                blk.iter_mut().for_each(|v| *v *= s);
            }
            _ => {}
        }
    }
    x
}

/// The two formats of the A8 kernels: every test below runs both (Q4_0A8 = the same
/// contract over the widened q4_0 codes, through the q4 twins of the same kernels).
const A8_FORMATS: [WeightFormat; 2] = [WeightFormat::Q8_0A8, WeightFormat::Q4_0A8];

/// The q8_0 blocks the contract multiplies: Q8_0A8's own, or Q4_0A8's widened.
fn weight_blocks(hw: &HostWeight) -> Vec<BlockQ8_0> {
    match &hw.data {
        HostData::Q8_0A8(b) => b.clone(),
        HostData::Q4_0A8(b) => b.iter().map(dflash_quant::widen_q4_0).collect(),
        _ => panic!("not a Q8_0A8 / Q4_0A8 weight"),
    }
}

/// The contract, transcribed on the host.
fn contract(x: &[f32], rows: usize, k: usize, w: &[BlockQ8_0], n: usize) -> Vec<f32> {
    assert_eq!(A8_CHUNK_BLOCKS, 32, "the contract's chunk is 32 blocks");
    let kb = k / 32;
    let xq: Vec<BlockQ8_0> = (0..rows)
        .flat_map(|r| quantize_q8_0(&x[r * k..(r + 1) * k]).expect("finite x"))
        .collect();
    let mut out = vec![0.0f32; rows * n];
    for r in 0..rows {
        for o in 0..n {
            let mut total = 0.0f32;
            for (c, b0) in (0..kb).step_by(32).enumerate() {
                let mut acc = 0.0f32;
                for b in b0..(b0 + 32).min(kb) {
                    let (wb, xb) = (&w[o * kb + b], &xq[r * kb + b]);
                    let isum: i32 = wb
                        .qs
                        .iter()
                        .zip(&xb.qs)
                        .map(|(&a, &c)| a as i32 * c as i32)
                        .sum();
                    acc = (isum as f32).mul_add(wb.d.to_f32() * xb.d.to_f32(), acc);
                }
                total = if c == 0 { acc } else { total + acc };
            }
            out[r * n + o] = total;
        }
    }
    out
}

fn assert_bits(what: &str, got: &[f32], want: &[f32], n: usize) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    if let Some(i) = bad {
        panic!(
            "{what}: row {} col {}: gpu {} vs {} ({} of {} values differ)",
            i / n,
            i % n,
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

#[test]
fn a8_activation_quantizer_is_byte_exact() {
    let Some(g) = gpu("a8_activation_quantizer_is_byte_exact") else {
        return;
    };
    let mut r = rng("a8_activation_quantizer_is_byte_exact");
    for &(rows, k) in &[(1usize, 32usize), (5, 288), (8, 4096), (9, 96), (16, 12288)] {
        let x = spread_x(&mut r, rows, k);
        let xg = g.upload(&x).expect("upload");
        let (codes, scales) = g.a8_quantize_rows(&xg, rows, k).expect("quantize");
        let want = quantize_q8_0(&x).expect("finite");
        for (i, b) in want.iter().enumerate() {
            assert_eq!(
                scales[i],
                b.d.to_bits(),
                "rows={rows} k={k}: scale of block {i} (row {}, block {})",
                i / (k / 32),
                i % (k / 32)
            );
            assert_eq!(
                &codes[i * 32..(i + 1) * 32],
                &b.qs[..],
                "rows={rows} k={k}: codes of block {i}"
            );
        }
        eprintln!(
            "EXACT a8 quantize rows={rows} k={k}: {} blocks byte-identical",
            want.len()
        );
    }
}

#[test]
fn a8_matmul_matches_the_contract_bit_for_bit() {
    let Some(g) = gpu("a8_matmul_matches_the_contract_bit_for_bit") else {
        return;
    };
    let mut r = rng("a8_matmul_matches_the_contract_bit_for_bit");
    for fmt in A8_FORMATS {
        // Ragged N (partial 16-row tiles), K with partial pipeline stages (288 = 9 blocks), a
        // partial last chunk (1056 = 33 blocks, 1312 = 41, 5120 + 32), the 8B and 27B drafters'
        // K (4096, 12288, 5120, 17408), tall head-like matrices (whole-K kernel under auto, one
        // and several chunks).
        let shapes = [
            (17usize, 32usize),
            (300, 288),
            (1000, 1056),
            (333, 1312),
            (1024, 4096),
            (4096, 4096),
            (512, 12288),
            (1000, 5120),
            (77, 5152),
            (520, 17408),
            (40000, 96),
            (20000, 256),
            (36000, 1312),
        ];
        for &(n, k) in &shapes {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let wg = g.upload_weight(&hw).expect("gpu weight");
            let big = n * k > 4096 * 1024;
            let rows_list: &[usize] = if big {
                &[1, 7, 9, 16]
            } else {
                &[1, 3, 7, 8, 9, 15, 16, 17, 33, 40]
            };
            for &rows in rows_list {
                let x = spread_x(&mut r, rows, k);
                let want = contract(&x, rows, k, &weight_blocks(&hw), n);
                let xg = g.upload(&x).expect("upload");
                let mut og = poisoned(g, rows * n);
                g.matmul(&xg, rows, &wg, &mut og).expect("gpu matmul");
                let got = g.download(&og).expect("download");
                assert_bits(&format!("{fmt:?} n={n} k={k} rows={rows}"), &got, &want, n);
            }
            eprintln!(
            "EXACT matmul {fmt:?} n={n} k={k}: rows {rows_list:?} bit-identical to the contract"
        );
        }
    }
}

#[test]
fn a8_matmul_matches_the_cpu_backend_bit_for_bit() {
    let Some(g) = gpu("a8_matmul_matches_the_cpu_backend_bit_for_bit") else {
        return;
    };
    let cpu = Cpu::new();
    let mut r = rng("a8_matmul_matches_the_cpu_backend_bit_for_bit");
    for fmt in A8_FORMATS {
        for &(n, k) in &[
            (4096usize, 4096usize),
            (333, 160),
            (1000, 12288),
            (1000, 5120),
            (300, 17408),
            (500, 1312),
        ] {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let wc = cpu.upload_weight(&hw).expect("cpu weight");
            let wg = g.upload_weight(&hw).expect("gpu weight");
            for rows in [1usize, 7, 8, 9, 16, 33] {
                let x = spread_x(&mut r, rows, k);
                let mut oc = vec![0.0f32; rows * n];
                cpu.matmul(&x, rows, &wc, &mut oc).expect("cpu matmul");
                let xg = g.upload(&x).expect("upload");
                let mut og = poisoned(g, rows * n);
                g.matmul(&xg, rows, &wg, &mut og).expect("gpu matmul");
                let got = g.download(&og).expect("download");
                assert_bits(
                    &format!("{fmt:?} vs cpu n={n} k={k} rows={rows}"),
                    &got,
                    &oc,
                    n,
                );
            }
            eprintln!("EXACT matmul {fmt:?} n={n} k={k}: bit-identical to the CPU backend");
        }
    }
}

#[test]
fn a8_matmul_is_per_row_deterministic() {
    let Some(g) = gpu("a8_matmul_is_per_row_deterministic") else {
        return;
    };
    let mut r = rng("a8_matmul_is_per_row_deterministic");
    for fmt in A8_FORMATS {
        for &(n, k) in &[
            (1024usize, 4096usize),
            (40000, 64),
            (333, 160),
            (600, 17408),
            (36000, 1312),
        ] {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let wg = g
                .upload_weight(&HostWeight::from_f32("w", n, k, &wv, fmt).expect("e"))
                .expect("w");
            let xv = spread_x(&mut r, 16, k);
            let xg = g.upload(&xv).expect("x");
            let mut all = poisoned(g, 16 * n);
            g.matmul(&xg, 16, &wg, &mut all).expect("16 rows");
            let all = g.download(&all).expect("dl");
            for rows in [1usize, 5, 9] {
                let xs = g.upload(&xv[..rows * k]).expect("x");
                let mut o = poisoned(g, rows * n);
                g.matmul(&xs, rows, &wg, &mut o).expect("few rows");
                let o = g.download(&o).expect("dl");
                assert_bits(
                    &format!("{fmt:?} n={n} k={k}: {rows} rows vs 16"),
                    &o,
                    &all[..rows * n],
                    n,
                );
            }
            eprintln!(
                "DETERMINISM matmul {fmt:?} n={n} k={k}: rows 1/5/9 bit-identical to a 16-row call"
            );
        }
    }
}

#[test]
fn a8_gather_rows_is_q8_0_dequantization() {
    let Some(g) = gpu("a8_gather_rows_is_q8_0_dequantization") else {
        return;
    };
    let mut r = rng("a8_gather_rows_is_q8_0_dequantization");
    for fmt in A8_FORMATS {
        let (n, k) = (1000usize, 288usize);
        let wv = rand_vec(&mut r, n * k, 3.0);
        let hw = HostWeight::from_f32("emb", n, k, &wv, fmt).expect("encode");
        let wg = g.upload_weight(&hw).expect("w");
        let ids: Vec<u32> = (0..17).map(|_| r.random_range(0..n as u32)).collect();
        let mut og = poisoned(g, ids.len() * k);
        g.gather_rows(&wg, &ids, &mut og).expect("gpu");
        let got = g.download(&og).expect("dl");
        let all = hw.to_f32();
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| all[i as usize * k..(i as usize + 1) * k].to_vec())
            .collect();
        assert_bits(&format!("gather_rows {fmt:?}"), &got, &want, k);
        eprintln!("EXACT gather_rows {fmt:?}: 17 rows identical to q8_0 dequantization");
    }
}

#[test]
fn a8_matmul_many_equals_separate_matmuls_bit_for_bit() {
    let Some(g) = gpu("a8_matmul_many_equals_separate_matmuls_bit_for_bit") else {
        return;
    };
    let mut r = rng("a8_matmul_many_equals_separate_matmuls_bit_for_bit");
    for fmt in A8_FORMATS {
        let k = 4096usize;
        let ns = [4096usize, 1024, 1000];
        let hws: Vec<HostWeight> = ns
            .iter()
            .map(|&n| {
                let wv = rand_vec(&mut r, n * k, 1.0);
                HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode")
            })
            .collect();
        let wgs: Vec<_> = hws.iter().map(|h| g.upload_weight(h).expect("w")).collect();
        for rows in [1usize, 9, 16, 20] {
            let x = spread_x(&mut r, rows, k);
            let xg = g.upload(&x).expect("x");
            for m in 1..=3 {
                let ws: Vec<_> = wgs[..m].iter().collect();
                let mut outs: Vec<_> = ns[..m].iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut refs: Vec<_> = outs.iter_mut().collect();
                g.matmul_many(&xg, rows, &ws, &mut refs).expect("many");
                for (i, o) in outs.iter().enumerate() {
                    let got = g.download(o).expect("dl");
                    let mut sep = poisoned(g, rows * ns[i]);
                    g.matmul(&xg, rows, &wgs[i], &mut sep).expect("one");
                    let want = g.download(&sep).expect("dl");
                    assert_bits(
                        &format!("matmul_many({m}) matrix {i} rows={rows}"),
                        &got,
                        &want,
                        ns[i],
                    );
                    if rows <= 9 {
                        let c = contract(&x, rows, k, &weight_blocks(&hws[i]), ns[i]);
                        assert_bits(
                            &format!("matmul_many({m}) matrix {i} vs contract"),
                            &got,
                            &c,
                            ns[i],
                        );
                    }
                }
            }
        }
        eprintln!(
        "EXACT matmul_many {fmt:?} (1-3 matrices, rows 1/9/16/20) == separate matmuls == contract"
    );
    }
}

#[test]
fn a8_matmul_many_of_both_formats_equals_separate_matmuls() {
    let Some(g) = gpu("a8_matmul_many_of_both_formats_equals_separate_matmuls") else {
        return;
    };
    let mut r = rng("a8_matmul_many_of_both_formats_equals_separate_matmuls");
    let k = 1312usize;
    let specs = [
        (1000usize, WeightFormat::Q8_0A8),
        (333, WeightFormat::Q4_0A8),
        (2000, WeightFormat::Q8_0A8),
    ];
    let hws: Vec<HostWeight> = specs
        .iter()
        .map(|&(n, f)| {
            HostWeight::from_f32("w", n, k, &rand_vec(&mut r, n * k, 1.0), f).expect("e")
        })
        .collect();
    let wgs: Vec<_> = hws.iter().map(|h| g.upload_weight(h).expect("w")).collect();
    let ws: Vec<_> = wgs.iter().collect();
    for rows in [1usize, 9, 16] {
        let x = spread_x(&mut r, rows, k);
        let xg = g.upload(&x).expect("x");
        let mut outs: Vec<_> = specs.iter().map(|&(n, _)| poisoned(g, rows * n)).collect();
        let mut refs: Vec<_> = outs.iter_mut().collect();
        g.matmul_many(&xg, rows, &ws, &mut refs).expect("many");
        for (i, o) in outs.iter().enumerate() {
            let n = specs[i].0;
            let want = contract(&x, rows, k, &weight_blocks(&hws[i]), n);
            assert_bits(
                &format!(
                    "mixed matmul_many matrix {i} ({:?}) rows={rows}",
                    specs[i].1
                ),
                &g.download(o).expect("dl"),
                &want,
                n,
            );
        }
    }
    eprintln!("EXACT matmul_many of Q8_0A8 + Q4_0A8 + Q8_0A8 matrices == the contract per matrix");
}

#[test]
fn a8_every_kernel_choice_matches_the_contract_bit_for_bit() {
    // A private backend: the kernel choice is per backend, and the shared one is used by
    // the other tests of this binary concurrently.
    if gpu("a8_every_kernel_choice_matches_the_contract_bit_for_bit").is_none() {
        return;
    }
    let g = dflash_cuda_kernels::Cuda::new(0).expect("second CUDA backend");
    let mut r = rng("a8_every_kernel_choice_matches_the_contract_bit_for_bit");
    for fmt in A8_FORMATS {
        use dflash_cuda_kernels::A8Kernel;
        let kernels = [
            A8Kernel::WholeK,
            A8Kernel::Split(1, 4, 3),
            A8Kernel::Split(1, 2, 3),
            A8Kernel::Split(2, 2, 4),
            A8Kernel::Split(2, 4, 3),
            A8Kernel::Split(2, 4, 2),
            A8Kernel::Split(4, 1, 3),
            A8Kernel::Split(4, 2, 3),
            A8Kernel::Split(4, 2, 2),
            A8Kernel::Split(4, 4, 2),
            A8Kernel::SplitApart(4, 1, 3),
            A8Kernel::SplitApart(1, 4, 3),
            A8Kernel::SplitApart(1, 2, 3),
            A8Kernel::SplitApart(2, 2, 4),
            A8Kernel::SplitApart(4, 2, 2),
            A8Kernel::Auto,
        ];
        // Ragged tiles, a partial last stage (9 and 13 blocks), partial last chunks (33 and 41
        // blocks, 5152), odd tile counts (and tile groups), the drafters' mid-size shapes.
        for &(n, k) in &[
            (17usize, 32usize),
            (300, 288),
            (1000, 416),
            (1000, 1056),
            (333, 1312),
            (4096, 4096),
            (1024, 12288),
            (600, 5120),
            (77, 5152),
            (300, 17408),
            (36000, 1312),
        ] {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let wg = g.upload_weight(&hw).expect("gpu weight");
            for rows in [1usize, 7, 8, 9, 16] {
                let x = spread_x(&mut r, rows, k);
                let want = contract(&x, rows, k, &weight_blocks(&hw), n);
                let xg = g.upload(&x).expect("upload");
                for kern in kernels {
                    g.set_a8_kernel(kern);
                    // With and without programmatic dependent launch; with PDL also with every
                    // weight stage but one issued before the dependency wait.
                    for (pdl, pw) in [(true, None), (true, Some(true)), (false, None)] {
                        g.set_a8_pdl(pdl);
                        g.set_a8_prewait(pw);
                        let mut og = poisoned(&g, rows * n);
                        g.matmul(&xg, rows, &wg, &mut og).expect("gpu matmul");
                        let got = g.download(&og).expect("download");
                        assert_bits(
                            &format!(
                            "{fmt:?} {kern:?} pdl {pdl} pre-wait {pw:?} n={n} k={k} rows={rows}"
                        ),
                            &got,
                            &want,
                            n,
                        );
                    }
                    g.set_a8_pdl(false);
                    g.set_a8_prewait(None);
                }
            }
            eprintln!("EXACT matmul {fmt:?} n={n} k={k}: whole-K, split (w, ks, stages) 1x4x3 / 2x2x4 / 2x4x3 / 2x4x2 / 4x2x3 / 4x2x2 / 4x4x2, split apart 1x4x3 / 2x2x4 / 4x2x2, auto, with and without PDL, one or all but one weight stages before the wait == contract");
        }
        // Fused launches (3 matrices, different tile counts; a tall one with a partial last
        // chunk, so that blocks' item ranges cross matrix boundaries) under every choice.
        for (k, ns) in [
            (4096usize, [4096usize, 1024, 1000]),
            (1312, [2000, 333, 36000]),
            (5152, [1000, 333, 600]),
        ] {
            let hws: Vec<HostWeight> = ns
                .iter()
                .map(|&n| {
                    let wv = rand_vec(&mut r, n * k, 1.0);
                    HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode")
                })
                .collect();
            let wgs: Vec<_> = hws.iter().map(|h| g.upload_weight(h).expect("w")).collect();
            let ws: Vec<_> = wgs.iter().collect();
            for rows in [3usize, 16] {
                let x = spread_x(&mut r, rows, k);
                let xg = g.upload(&x).expect("x");
                let wants: Vec<Vec<f32>> = (0..3)
                    .map(|i| contract(&x, rows, k, &weight_blocks(&hws[i]), ns[i]))
                    .collect();
                for kern in kernels {
                    g.set_a8_kernel(kern);
                    let mut outs: Vec<_> = ns.iter().map(|&n| poisoned(&g, rows * n)).collect();
                    let mut refs: Vec<_> = outs.iter_mut().collect();
                    g.matmul_many(&xg, rows, &ws, &mut refs).expect("many");
                    for (i, o) in outs.iter().enumerate() {
                        let got = g.download(o).expect("dl");
                        assert_bits(
                            &format!("matmul_many {kern:?} k={k} matrix {i} rows={rows}"),
                            &got,
                            &wants[i],
                            ns[i],
                        );
                    }
                }
            }
        }
        // matmul_silu_mul (SiLU product inside the x quantizer) == silu_mul + matmul, under every
        // choice, K of one and of several chunks.
        for &(n, k) in &[(1000usize, 416usize), (4096, 12288), (300, 5152)] {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let wg = g.upload_weight(&hw).expect("w");
            for rows in [1usize, 9, 16] {
                let gate = g.upload(&spread_x(&mut r, rows, k)).expect("gate");
                let up = g.upload(&spread_x(&mut r, rows, k)).expect("up");
                for kern in kernels {
                    g.set_a8_kernel(kern);
                    let mut act = poisoned(&g, rows * k);
                    g.silu_mul(&gate, &up, &mut act).expect("silu_mul");
                    let mut sep = poisoned(&g, rows * n);
                    g.matmul(&act, rows, &wg, &mut sep).expect("matmul");
                    let mut act2 = poisoned(&g, rows * k);
                    let mut fused = poisoned(&g, rows * n);
                    g.matmul_silu_mul(&gate, &up, &mut act2, rows, &wg, &mut fused)
                        .expect("fused");
                    assert_bits(
                        &format!("matmul_silu_mul {kern:?} n={n} k={k} rows={rows}"),
                        &g.download(&fused).expect("dl"),
                        &g.download(&sep).expect("dl"),
                        n,
                    );
                }
            }
        }
        g.set_a8_kernel(A8Kernel::Auto);
        eprintln!(
        "EXACT matmul_many and matmul_silu_mul {fmt:?} under every kernel choice == contract / separate ops"
    );
    }
}

#[test]
fn a8_norm_into_activation_and_residual_stores_equal_the_separate_ops_bit_for_bit() {
    // A private backend: the kernel choice is per backend.
    if gpu("a8_norm_into_activation_and_residual_stores_equal_the_separate_ops_bit_for_bit")
        .is_none()
    {
        return;
    }
    let g = dflash_cuda_kernels::Cuda::new(0).expect("second CUDA backend");
    let mut r =
        rng("a8_norm_into_activation_and_residual_stores_equal_the_separate_ops_bit_for_bit");
    for fmt in A8_FORMATS {
        use dflash_cuda_kernels::A8Kernel;
        let kernels = [
            A8Kernel::WholeK,
            A8Kernel::Split(1, 4, 3),
            A8Kernel::Split(2, 2, 4),
            A8Kernel::Split(4, 2, 2),
            A8Kernel::SplitApart(4, 2, 2),
            A8Kernel::Auto,
        ];
        let eps = 1e-6f32;
        // rms_norm_q8 + matmul_many_q8 == rms_norm + matmul_many: one register slot per row
        // (dim 96), several blocks per row (4096, 5120), a row offset (the lm_head rows).
        for &(dim, ref ns) in &[
            (96usize, vec![50usize]),
            (416, vec![1000, 333]),
            (4096, vec![4096, 1024, 1024]),
            (5120, vec![600]),
        ] {
            let hws: Vec<HostWeight> = ns
                .iter()
                .map(|&n| {
                    let wv = rand_vec(&mut r, n * dim, 1.0);
                    HostWeight::from_f32("w", n, dim, &wv, fmt).expect("encode")
                })
                .collect();
            let wgs: Vec<_> = hws.iter().map(|h| g.upload_weight(h).expect("w")).collect();
            let ws: Vec<_> = wgs.iter().collect();
            let nw = g.upload(&rand_vec(&mut r, dim, 1.0)).expect("norm w");
            for &(row0, rows) in &[(0usize, 1usize), (0, 9), (1, 15), (0, 16)] {
                let total = row0 + rows;
                let h = g.upload(&spread_x(&mut r, total, dim)).expect("h");
                let mut xn = poisoned(&g, total * dim);
                g.rms_norm(&h, &nw, dim, eps, &mut xn).expect("rms_norm");
                let xv = g.download(&xn).expect("dl");
                let xrows = g.upload(&xv[row0 * dim..]).expect("rows");
                for kern in kernels {
                    g.set_a8_kernel(kern);
                    let mut want: Vec<_> = ns.iter().map(|&n| poisoned(&g, rows * n)).collect();
                    let mut refs: Vec<_> = want.iter_mut().collect();
                    g.matmul_many(&xrows, rows, &ws, &mut refs).expect("many");
                    let mut got: Vec<_> = ns.iter().map(|&n| poisoned(&g, rows * n)).collect();
                    let mut refs: Vec<_> = got.iter_mut().collect();
                    let act = g
                        .rms_norm_q8(&h, row0, rows, &nw, dim, eps)
                        .expect("rms_norm_q8");
                    assert_eq!((act.k(), act.rows()), (dim, rows));
                    g.matmul_many_q8(&act, &ws, &mut refs, false)
                        .expect("many_q8");
                    for i in 0..ns.len() {
                        assert_bits(
                        &format!("rms_norm_q8 + matmul_many_q8 {kern:?} dim={dim} matrix {i} rows {row0}+{rows}"),
                        &g.download(&got[i]).expect("dl"),
                        &g.download(&want[i]).expect("dl"),
                        ns[i],
                    );
                    }
                }
            }
            // A later launch writing the activation's slot (a quantizer, another producer): the
            // activation is stale, an error, not a read of other data; a weight of another K: an
            // error.
            let h = g.upload(&spread_x(&mut r, 4, dim)).expect("h");
            let act = g.rms_norm_q8(&h, 0, 4, &nw, dim, eps).expect("rms_norm_q8");
            let mut o = poisoned(&g, 4 * ns[0]);
            g.matmul(&h, 4, &wgs[0], &mut o).expect("matmul");
            assert!(g
                .matmul_many_q8(&act, &ws[..1], &mut [&mut o], false)
                .is_err());
            let act = g.rms_norm_q8(&h, 0, 4, &nw, dim, eps).expect("rms_norm_q8");
            let newer = g.rms_norm_q8(&h, 0, 4, &nw, dim, eps).expect("rms_norm_q8");
            assert!(g
                .matmul_many_q8(&act, &ws[..1], &mut [&mut o], false)
                .is_err());
            g.matmul_many_q8(&newer, &ws[..1], &mut [&mut o], false)
                .expect("current");
            let other_k = g
                .upload_weight(
                    &HostWeight::from_f32("w", 32, dim + 32, &vec![0.5; 32 * (dim + 32)], fmt)
                        .expect("encode"),
                )
                .expect("w");
            let mut o2 = poisoned(&g, 4 * 32);
            assert!(g
                .matmul_many_q8(&newer, &[&other_k], &mut [&mut o2], false)
                .is_err());
        }
        // matmul_add == matmul + add_assign and matmul_silu_mul_add == matmul_silu_mul +
        // add_assign: one chunk, several, several rounds across blocks (SplitApart: a8_sum adds).
        for &(n, k) in &[(1000usize, 416usize), (4096, 4096), (300, 17408)] {
            let wv = rand_vec(&mut r, n * k, 1.0);
            let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
            let wg = g.upload_weight(&hw).expect("w");
            for rows in [1usize, 9, 16] {
                let x = g.upload(&spread_x(&mut r, rows, k)).expect("x");
                let up = g.upload(&spread_x(&mut r, rows, k)).expect("up");
                let h0 = rand_vec(&mut r, rows * n, 1.0);
                for kern in kernels {
                    g.set_a8_kernel(kern);
                    for silu in [false, true] {
                        let mut want = g.upload(&h0).expect("h");
                        let mut o = poisoned(&g, rows * n);
                        let mut act = poisoned(&g, rows * k);
                        if silu {
                            g.matmul_silu_mul(&x, &up, &mut act, rows, &wg, &mut o)
                                .expect("mm");
                        } else {
                            g.matmul(&x, rows, &wg, &mut o).expect("mm");
                        }
                        g.add_assign(&mut want, 0, &o, rows * n).expect("add");
                        let mut got = g.upload(&h0).expect("h");
                        if silu {
                            g.matmul_silu_mul_add(&x, &up, rows, &wg, &mut got)
                                .expect("add fused");
                        } else {
                            g.matmul_add(&x, rows, &wg, &mut got).expect("add fused");
                        }
                        assert_bits(
                            &format!("matmul_add (silu {silu}) {kern:?} n={n} k={k} rows={rows}"),
                            &g.download(&got).expect("dl"),
                            &g.download(&want).expect("dl"),
                            n,
                        );
                    }
                }
            }
        }
        // matmul_gate_up_q8 + matmul_many_q8 (down, accumulate) == matmul_many (gate, up) +
        // matmul_silu_mul + add_assign: one and several feature groups, a padded last block of
        // the down activation (992 = 31 blocks), 1-16 rows.
        // Then the automatic kernel with and without the queue launch, where the paired groups
        // spread unevenly over the SMs: this device's SMs + 8 groups over 3 chunks (the last one
        // block), and 4 x SMs + 16 groups over 5 chunks (the 27B shape on 132 SMs).
        let sms = g.num_sms();
        let mut queue_runs = 0usize;
        for &(d, inter) in &[
            (96usize, 64usize),
            (416, 992),
            (4096, 12288),
            (2080, 32 * (sms + 8)),
            (5120, 32 * (4 * sms + 16)),
        ] {
            let mk = |r: &mut StdRng, n: usize, k: usize| {
                let wv = rand_vec(r, n * k, 1.0);
                let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
                g.upload_weight(&hw).expect("w")
            };
            let (wg, wu, wd) = (
                mk(&mut r, inter, d),
                mk(&mut r, inter, d),
                mk(&mut r, d, inter),
            );
            let nw = g.upload(&rand_vec(&mut r, d, 1.0)).expect("norm w");
            for rows in [1usize, 9, 16] {
                let h = g.upload(&spread_x(&mut r, rows, d)).expect("h");
                let h0 = rand_vec(&mut r, rows * d, 1.0);
                let mut xn = poisoned(&g, rows * d);
                g.rms_norm(&h, &nw, d, eps, &mut xn).expect("rms_norm");
                let (mut gate, mut up) = (poisoned(&g, rows * inter), poisoned(&g, rows * inter));
                g.matmul_many(&xn, rows, &[&wg, &wu], &mut [&mut gate, &mut up])
                    .expect("gate/up");
                let mut act = poisoned(&g, rows * inter);
                let mut o = poisoned(&g, rows * d);
                g.matmul_silu_mul(&gate, &up, &mut act, rows, &wd, &mut o)
                    .expect("down");
                let mut want = g.upload(&h0).expect("h0");
                g.add_assign(&mut want, 0, &o, rows * d).expect("add");
                // Every paired kernel (k-slices, stages), the down projection with its automatic
                // pre-wait stages (all but one after the paired launch) and with one: the same bits.
                for ((ks, st), pw) in [
                    ((2u8, 2u8), None),
                    ((1, 3), None),
                    ((1, 3), Some(false)),
                    ((1, 2), None),
                    ((0, 0), None),
                    ((0, 1), None),
                ] {
                    // (0, q): the automatic kernel, the queue launch on (q = 0) or off.
                    if ks == 0 {
                        g.set_a8_pair_kernel_auto();
                        g.set_a8_pair_queue(st == 0);
                        let plan = g.a8_pair_queue_plan(inter, d, rows, fmt);
                        let uneven = inter == 32 * (sms + 8) || inter == 32 * (4 * sms + 16);
                        if uneven {
                            assert_eq!(
                            plan.is_some(),
                            st == 0,
                            "queue plan {plan:?} for inter={inter} d={d} rows={rows} on {sms} SMs"
                        );
                        }
                        queue_runs += usize::from(plan.is_some());
                    } else {
                        g.set_a8_pair_kernel(ks, st).expect("pair kernel");
                    }
                    g.set_a8_prewait(pw);
                    let mut got = g.upload(&h0).expect("h0");
                    let act = g
                        .rms_norm_q8(&h, 0, rows, &nw, d, eps)
                        .expect("rms_norm_q8");
                    let act2 = g.matmul_gate_up_q8(&act, &wg, &wu).expect("gate_up_q8");
                    g.matmul_many_q8(&act2, &[&wd], &mut [&mut got], true)
                        .expect("down_q8");
                    assert_bits(
                    &format!(
                        "matmul_gate_up_q8 ({}) + down (pre-wait {pw:?}) d={d} inter={inter} rows={rows}",
                        if ks == 0 {
                            format!("auto, queue {}", st == 0)
                        } else {
                            format!("{ks} slices, {st} stages")
                        }
                    ),
                    &g.download(&got).expect("dl"),
                    &g.download(&want).expect("dl"),
                    d,
                );
                    // The down activation as gate / up's input (second slot, K = inter): an error.
                    assert!(g.matmul_gate_up_q8(&act2, &wg, &wu).is_err());
                }
            }
        }
        assert!(
            queue_runs >= 2 * 3,
            "the queue launch ran for both uneven shapes at 1, 9, 16 rows: {queue_runs}"
        );
        assert!(g.set_a8_pair_kernel(1, 4).is_err());
        g.set_a8_pair_kernel_auto();
        g.set_a8_pair_queue(true);
        g.set_a8_prewait(None);
        // attention_q8 + matmul_many_q8 (accumulate) == attention + matmul_add: the split combine
        // writing the activation (head dims 128 / 64 / 256, block and causal masks, padding
        // tokens) and the quantizer after the generic kernel (head dim 48); over an f16 cache
        // (kv16) the same against attention_fast_kv16 (its own kernel at head dim 128, the
        // unpacking path at 48).
        use dflash_backend::{AttnParams, KvStorage};
        g.set_a8_kernel(A8Kernel::Auto);
        for &(n_q, h, hkv, d, n_kv, causal, fast, kv16) in &[
            (
                16usize, 32usize, 8usize, 128usize, 528usize, false, true, false,
            ),
            (16, 32, 8, 128, 528, false, false, false),
            (5, 16, 4, 64, 300, true, false, false),
            (9, 32, 8, 48, 200, false, true, false),
            (12, 4, 2, 256, 100, false, false, false),
            (16, 32, 8, 128, 2600, false, true, true),
            (7, 16, 4, 64, 300, true, true, true),
            (9, 32, 8, 48, 200, false, true, true),
        ] {
            let kdim = h * d;
            let wv = rand_vec(&mut r, 640 * kdim, 1.0);
            let hw = HostWeight::from_f32("wo", 640, kdim, &wv, fmt).expect("encode");
            let wo = g.upload_weight(&hw).expect("w");
            let q = g.upload(&rand_vec(&mut r, n_q * kdim, 1.0)).expect("q");
            let mut kc = g.upload(&rand_vec(&mut r, n_kv * hkv * d, 1.0)).expect("k");
            let mut vc = g.upload(&rand_vec(&mut r, n_kv * hkv * d, 1.0)).expect("v");
            let kv = if kv16 { KvStorage::F16 } else { KvStorage::F32 };
            if kv16 {
                let n = n_kv * hkv * d;
                let (mut k16, mut v16) =
                    (g.zeros(n / 2).expect("k16"), g.zeros(n / 2).expect("v16"));
                g.f16_pack(&kc, &mut k16, 0, n).expect("pack");
                g.f16_pack(&vc, &mut v16, 0, n).expect("pack");
                (kc, vc) = (k16, v16);
            }
            let p = AttnParams {
                n_q,
                n_kv,
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: d,
                q_pos0: n_kv - n_q,
                kv_pos0: 0,
                causal,
                window: None,
                scale: (d as f32).powf(-0.5),
            };
            let h0 = rand_vec(&mut r, n_q * 640, 1.0);
            let mut att = poisoned(&g, n_q * kdim);
            if kv16 {
                g.attention_fast_kv16(&q, &kc, &vc, &p, &mut att)
                    .expect("attention");
            } else if fast {
                g.attention_fast(&q, &kc, &vc, &p, &mut att)
                    .expect("attention");
            } else {
                g.attention(&q, &kc, &vc, &p, &mut att).expect("attention");
            }
            let mut want = g.upload(&h0).expect("h");
            g.matmul_add(&att, n_q, &wo, &mut want).expect("matmul_add");
            let mut att2 = poisoned(&g, n_q * kdim);
            let act = g
                .attention_q8(&q, &kc, &vc, &p, fast, kv, &mut att2)
                .expect("attention_q8");
            let mut got = g.upload(&h0).expect("h");
            g.matmul_many_q8(&act, &[&wo], &mut [&mut got], true)
                .expect("many_q8");
            let what =
                format!("attention_q8 n_q={n_q} d={d} causal={causal} fast={fast} kv16={kv16}");
            assert_bits(
                &what,
                &g.download(&att2).expect("dl"),
                &g.download(&att).expect("dl"),
                kdim,
            );
            assert_bits(
                &what,
                &g.download(&got).expect("dl"),
                &g.download(&want).expect("dl"),
                640,
            );
        }
        g.set_a8_kernel(A8Kernel::Auto);
        eprintln!("EXACT rms_norm_q8 + matmul_many_q8, matmul_add and matmul_silu_mul_add == the separate ops under every kernel choice; matmul_gate_up_q8 + down == the separate ops; attention_q8 + matmul_many_q8 == attention + matmul_add");
    }
}

/// A layer tail's scratch buffers, poisoned (a fused tail leaves them unwritten).
struct TailBufs {
    o: CudaBuf,
    xn: CudaBuf,
    gate: CudaBuf,
    up: CudaBuf,
    act: CudaBuf,
}

impl TailBufs {
    fn new(g: &Cuda, rows: usize, d: usize, inter: usize) -> Self {
        TailBufs {
            o: poisoned(g, rows * d),
            xn: poisoned(g, rows * d),
            gate: poisoned(g, rows * inter),
            up: poisoned(g, rows * inter),
            act: poisoned(g, rows * inter),
        }
    }

    fn scratch(&mut self) -> TailScratch<'_, Cuda> {
        TailScratch {
            o: &mut self.o,
            xn: &mut self.xn,
            gate: &mut self.gate,
            up: &mut self.up,
            act: &mut self.act,
        }
    }
}

#[test]
fn a8_layer_tail_and_norm_matmul_many_equal_the_separate_ops_bit_for_bit() {
    if gpu("a8_layer_tail_and_norm_matmul_many_equal_the_separate_ops_bit_for_bit").is_none() {
        return;
    }
    // A private backend (the shared one runs the other tests' launches concurrently).
    let g = &dflash_cuda_kernels::Cuda::new(0).expect("second CUDA backend");
    let mut r = rng("a8_layer_tail_and_norm_matmul_many_equal_the_separate_ops_bit_for_bit");
    for fmt in A8_FORMATS {
        use dflash_backend::{layer_tail_ops, norm_rows_matmul_ops, LayerTail};
        // (hidden, heads * head_dim, intermediate): the shipped drafter's size class and the 8B's.
        for &(d, kq, inter) in &[(256usize, 256usize, 768usize), (4096, 4096, 12288)] {
            let mut mk = |n: usize, k: usize| {
                let wv = rand_vec(&mut r, n * k, 1.0);
                let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
                g.upload_weight(&hw).expect("w")
            };
            let (wo, wg, wu, wd) = (mk(d, kq), mk(inter, d), mk(inter, d), mk(d, inter));
            let ln = g.upload(&rand_vec(&mut r, d, 1.0)).expect("ln");
            let tail = LayerTail {
                wo: &wo,
                post_norm: &ln,
                eps: 1e-6,
                w_gate: &wg,
                w_up: &wu,
                w_down: &wd,
            };
            for rows in [1usize, 9, 16] {
                let attn = g.upload(&spread_x(&mut r, rows, kq)).expect("attn");
                let h0 = rand_vec(&mut r, rows * d, 1.0);
                let mut outs = Vec::new();
                for fused in [false, true] {
                    let mut h = g.upload(&h0).expect("h");
                    let mut tb = TailBufs::new(g, rows, d, inter);
                    let s = tb.scratch();
                    if fused {
                        g.layer_tail(&attn, rows, &mut h, &tail, s)
                            .expect("layer_tail");
                        // The fused launches ran (the separate ops would have written xn).
                        let xv = g.download(&tb.xn).expect("dl");
                        assert!(
                            xv.iter().all(|v| v.is_nan()),
                            "layer_tail fell back to the separate ops"
                        );
                    } else {
                        layer_tail_ops(g, &attn, rows, &mut h, &tail, s).expect("ops");
                    }
                    outs.push(g.download(&h).expect("dl"));
                }
                assert_bits(
                    &format!("layer_tail d={d} rows={rows}"),
                    &outs[1],
                    &outs[0],
                    d,
                );
                // attention_layer_tail (the attention writing the o projection's activation) ==
                // the attention op + layer_tail.
                check_attention_layer_tail(g, &mut r, &tail, rows, kq, &h0, &format!("{fmt:?}"));
                // norm_rows_matmul (a final norm + the lm_head over rows 1..) == the separate ops,
                // xn unwritten.
                if rows > 1 {
                    let x = g.upload(&spread_x(&mut r, rows, d)).expect("x");
                    let n = rows - 1;
                    let mut want = poisoned(g, n * inter);
                    let mut xn = poisoned(g, rows * d);
                    norm_rows_matmul_ops(g, &x, &ln, d, 1e-6, 1, n, &mut xn, &wg, &mut want)
                        .expect("ops");
                    let mut got = poisoned(g, n * inter);
                    let mut xn2 = poisoned(g, rows * d);
                    g.norm_rows_matmul(&x, &ln, d, 1e-6, 1, n, &mut xn2, &wg, &mut got)
                        .expect("norm_rows_matmul");
                    assert!(g.download(&xn2).expect("dl").iter().all(|v| v.is_nan()));
                    assert_bits(
                        &format!("norm_rows_matmul d={d} rows 1..{rows}"),
                        &g.download(&got).expect("dl"),
                        &g.download(&want).expect("dl"),
                        inter,
                    );
                }
                // norm_matmul_many (the q/k/v of a layer) == rms_norm + matmul_many, xn unwritten.
                let x = g.upload(&spread_x(&mut r, rows, d)).expect("x");
                let ws = [&wg, &wu];
                let mut want = [poisoned(g, rows * inter), poisoned(g, rows * inter)];
                let mut xn = poisoned(g, rows * d);
                g.rms_norm(&x, &ln, d, 1e-6, &mut xn).expect("rms_norm");
                let [w0, w1] = &mut want;
                g.matmul_many(&xn, rows, &ws, &mut [w0, w1]).expect("many");
                let mut got = [poisoned(g, rows * inter), poisoned(g, rows * inter)];
                let mut xn2 = poisoned(g, rows * d);
                let [g0, g1] = &mut got;
                g.norm_matmul_many(&x, &ln, d, 1e-6, &mut xn2, rows, &ws, &mut [g0, g1])
                    .expect("norm_matmul_many");
                assert!(g.download(&xn2).expect("dl").iter().all(|v| v.is_nan()));
                for i in 0..2 {
                    assert_bits(
                        &format!("norm_matmul_many d={d} rows={rows} matrix {i}"),
                        &g.download(&got[i]).expect("dl"),
                        &g.download(&want[i]).expect("dl"),
                        inter,
                    );
                }
                // More than 3 matrices (a drafter's ingest: every layer's k / v): launches of up
                // to 3 reading one activation, and matmul_many alike.
                let x5 = g.upload(&spread_x(&mut r, rows, d)).expect("x");
                let mut xn5 = poisoned(g, rows * d);
                g.rms_norm(&x5, &ln, d, 1e-6, &mut xn5).expect("rms_norm");
                let wsd = [&wg, &wu, &wg, &wu, &wg];
                let mut want5: Vec<_> = (0..5).map(|_| poisoned(g, rows * inter)).collect();
                for (w, o) in wsd.iter().zip(want5.iter_mut()) {
                    g.matmul(&xn5, rows, w, o).expect("matmul");
                }
                let mut got5: Vec<_> = (0..5).map(|_| poisoned(g, rows * inter)).collect();
                let mut xn6 = poisoned(g, rows * d);
                let mut refs: Vec<_> = got5.iter_mut().collect();
                g.norm_matmul_many(&x5, &ln, d, 1e-6, &mut xn6, rows, &wsd, &mut refs)
                    .expect("norm_matmul_many x5");
                assert!(g.download(&xn6).expect("dl").iter().all(|v| v.is_nan()));
                let mut many5: Vec<_> = (0..5).map(|_| poisoned(g, rows * inter)).collect();
                let mut refs: Vec<_> = many5.iter_mut().collect();
                g.matmul_many(&xn5, rows, &wsd, &mut refs)
                    .expect("matmul_many x5");
                for i in 0..5 {
                    let want = g.download(&want5[i]).expect("dl");
                    for (what, got) in [("norm_matmul_many", &got5[i]), ("matmul_many", &many5[i])]
                    {
                        assert_bits(
                            &format!("{what} of 5 matrices d={d} rows={rows} matrix {i}"),
                            &g.download(got).expect("dl"),
                            &want,
                            inter,
                        );
                    }
                }
            }
        }
        eprintln!("EXACT layer_tail ({fmt:?}: residual stores, normed activation, paired gate/up), attention_layer_tail (exact / fast / fast over f16 caches), norm_matmul_many and norm_rows_matmul == the separate ops");
    }
}

#[test]
fn a8_graph_replays_match_the_contract() {
    // A captured graph replays correctly with new x each time: the automatic kernel and
    // SplitApart (its chunk-sum workspace and the second kernel), with and without
    // programmatic dependent launch, and with an L2 prefetch hint on the side stream forked
    // into and joined back to the capture (a private backend: these settings are per backend).
    if gpu("a8_graph_replays_match_the_contract").is_none() {
        return;
    }
    let g = dflash_cuda_kernels::Cuda::new(0).expect("second CUDA backend");
    let mut r = rng("a8_graph_replays_match_the_contract");
    for fmt in A8_FORMATS {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let (n, k, rows) = (1000usize, 4096usize, 16usize);
        let wv = rand_vec(&mut r, n * k, 1.0);
        let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
        let wg = g.upload_weight(&hw).expect("w");
        use dflash_cuda_kernels::A8Kernel;
        // More than 3 matrices per hint: an error, not a launch.
        let four: Vec<_> = (0..4).map(|_| (&wg, 0.0..1.0)).collect();
        assert!(g.l2_prefetch(&four).is_err());
        for (kern, pdl, prefetch) in [
            (A8Kernel::Auto, false, false),
            (A8Kernel::Auto, true, false),
            (A8Kernel::SplitApart(4, 2, 2), true, false),
            (A8Kernel::Auto, true, true),
        ] {
            g.set_a8_kernel(kern);
            g.set_a8_pdl(pdl);
            let mut xg = g.upload(&spread_x(&mut r, rows, k)).expect("x");
            let mut og = poisoned(&g, rows * n);
            // Eager first (scratch sized outside the capture).
            g.matmul(&xg, rows, &wg, &mut og).expect("eager");
            g.synchronize().expect("sync");
            let st = g.stream().clone();
            st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .expect("capture");
            let res = g.fill(&mut og, f32::NAN).and_then(|_| {
                if prefetch {
                    g.l2_prefetch(&[(&wg, 0.0..0.5), (&wg, 0.5..1.0)])?;
                }
                g.matmul(&xg, rows, &wg, &mut og)?;
                if prefetch {
                    g.l2_prefetch_join()?;
                }
                Ok(())
            });
            let graph = st
                .end_capture(CUgraphInstantiate_flags(0))
                .expect("end capture")
                .expect("graph");
            res.expect("captured ops");
            for rep in 0..4 {
                let x = spread_x(&mut r, rows, k);
                st.memcpy_htod(&x, xg.slice_mut()).expect("x");
                graph.launch().expect("replay");
                g.synchronize().expect("sync");
                let want = contract(&x, rows, k, &weight_blocks(&hw), n);
                let got = g.download(&og).expect("dl");
                assert_bits(
                    &format!("graph replay {rep} {kern:?} pdl {pdl} prefetch {prefetch}"),
                    &got,
                    &want,
                    n,
                );
            }
        }
        eprintln!(
        "EXACT matmul {fmt:?} n={n} k={k} rows={rows}: 4 graph replays == contract, auto (PDL off and on, with an L2 prefetch hint) and split apart"
    );
    }
}

/// `CudaOptions::block_trace`: a Q8_0A8 matmul leaves one wait record and one loop-end record
/// per block, each block index once, the times in order (the wait returns after it was
/// entered, the loop ends after the wait returned), and the same bits as an untraced backend;
/// without the option the trace calls are errors.
#[test]
fn a8_block_trace_records_every_block() {
    let Some(plain) = gpu("a8_block_trace_records_every_block") else {
        return;
    };
    assert!(plain.block_trace_reset().is_err());
    assert!(plain.block_trace().is_err());
    let g = dflash_cuda_kernels::Cuda::with_options(
        0,
        dflash_cuda_kernels::CudaOptions {
            block_trace: true,
            ..Default::default()
        },
    )
    .expect("traced CUDA backend");
    let mut r = rng("a8_block_trace_records_every_block");
    let (n, k, rows) = (1000usize, 4096usize, 16usize);
    let hw = HostWeight::from_f32(
        "w",
        n,
        k,
        &rand_vec(&mut r, n * k, 1.0),
        WeightFormat::Q8_0A8,
    )
    .expect("encode");
    let x = spread_x(&mut r, rows, k);
    let mut outs = Vec::new();
    for be in [plain, &g] {
        let wg = be.upload_weight(&hw).expect("w");
        let xg = be.upload(&x).expect("x");
        let mut og = poisoned(be, rows * n);
        be.matmul(&xg, rows, &wg, &mut og).expect("warm");
        if std::ptr::eq(be, &g) {
            g.block_trace_reset().expect("reset");
        }
        be.matmul(&xg, rows, &wg, &mut og).expect("matmul");
        outs.push(be.download(&og).expect("dl"));
    }
    assert_bits("traced matmul", &outs[1], &outs[0], n);
    let (recs, dropped) = g.block_trace().expect("records");
    assert_eq!(dropped, 0);
    use dflash_cuda_kernels::registry::BlockTraceKind;
    // The matmul kernel's records (the x quantizer, in the same module, waits too: its
    // records have another source line).
    let ends: Vec<_> = recs
        .iter()
        .filter(|r| r.module == "matmul" && r.kind == BlockTraceKind::End)
        .collect();
    assert!(!ends.is_empty(), "no loop-end records");
    let blocks = ends[0].blocks;
    let lines: std::collections::BTreeSet<u32> = recs
        .iter()
        .filter(|r| r.module == "matmul" && r.kind == BlockTraceKind::Wait)
        .map(|r| r.line)
        .collect();
    assert_eq!(
        lines.len(),
        2,
        "waits of the quantizer and the matmul: {lines:?}"
    );
    let waits: Vec<_> = recs
        .iter()
        .filter(|r| r.module == "matmul" && r.kind == BlockTraceKind::Wait && r.blocks == blocks)
        .filter(|r| Some(&r.line) == lines.iter().max())
        .collect();
    assert_eq!(waits.len(), blocks as usize, "one wait record per block");
    assert_eq!(ends.len(), blocks as usize, "one loop-end record per block");
    let mut seen = vec![None; blocks as usize];
    for w in &waits {
        assert_eq!(w.blocks, blocks);
        assert!(
            w.t1_ns >= w.t0_ns,
            "a wait returned before it was entered: {w:?}"
        );
        assert!(
            seen[w.block as usize].replace(w.t1_ns).is_none(),
            "block {} twice",
            w.block
        );
    }
    for e in &ends {
        let released = seen[e.block as usize].expect("an end without a wait");
        assert!(
            e.t0_ns >= released,
            "a loop ended before its wait returned: {e:?}"
        );
    }
}

/// bf16 / q8_0 / q4_0 weights: `layer_tail` and `norm_matmul_many` with the skinny producers
/// (the norms and the SiLU product writing the skinny matmuls' bf16 hi / lo x, the down
/// projection adding into h) give the bits of the separate ops, and leave xn unwritten (so
/// the producers ran). A producer's activation goes stale when another launch writes the pair.
#[test]
fn skinny_layer_tail_and_norm_matmul_many_equal_the_separate_ops_bit_for_bit() {
    if gpu("skinny_layer_tail_and_norm_matmul_many_equal_the_separate_ops_bit_for_bit").is_none() {
        return;
    }
    // A private backend (the shared one runs the other tests' launches concurrently).
    let g = &dflash_cuda_kernels::Cuda::new(0).expect("second CUDA backend");
    let mut r = rng("skinny_layer_tail_and_norm_matmul_many_equal_the_separate_ops_bit_for_bit");
    use dflash_backend::{layer_tail_ops, LayerTail};
    for fmt in [WeightFormat::Bf16, WeightFormat::Q8_0, WeightFormat::Q4_0] {
        // (hidden, heads * head_dim, intermediate): the shipped drafter's size class and the
        // 8B's (split and unsplit launches).
        for &(d, kq, inter) in &[(256usize, 256usize, 768usize), (4096, 4096, 12288)] {
            let mut mk = |n: usize, k: usize| {
                let wv = rand_vec(&mut r, n * k, 1.0);
                let hw = HostWeight::from_f32("w", n, k, &wv, fmt).expect("encode");
                g.upload_weight(&hw).expect("w")
            };
            let (wo, wg, wu, wd) = (mk(d, kq), mk(inter, d), mk(inter, d), mk(d, inter));
            let (wq, wk) = (mk(kq, d), mk(kq / 4, d));
            let ln = g.upload(&rand_vec(&mut r, d, 1.0)).expect("ln");
            let tail = LayerTail {
                wo: &wo,
                post_norm: &ln,
                eps: 1e-6,
                w_gate: &wg,
                w_up: &wu,
                w_down: &wd,
            };
            for rows in [1usize, 9, 16] {
                let attn = g.upload(&rand_vec(&mut r, rows * kq, 1.0)).expect("attn");
                let h0 = rand_vec(&mut r, rows * d, 1.0);
                let mut outs = Vec::new();
                for fused in [false, true] {
                    let mut h = g.upload(&h0).expect("h");
                    let mut tb = TailBufs::new(g, rows, d, inter);
                    let s = tb.scratch();
                    if fused {
                        g.layer_tail(&attn, rows, &mut h, &tail, s)
                            .expect("layer_tail");
                        let xv = g.download(&tb.xn).expect("dl");
                        assert!(
                            xv.iter().all(|v| v.is_nan()),
                            "{fmt:?}: layer_tail fell back to the separate ops"
                        );
                    } else {
                        layer_tail_ops(g, &attn, rows, &mut h, &tail, s).expect("ops");
                    }
                    outs.push(g.download(&h).expect("dl"));
                }
                assert_bits(
                    &format!("{fmt:?} layer_tail d={d} rows={rows}"),
                    &outs[1],
                    &outs[0],
                    d,
                );
                check_attention_layer_tail(g, &mut r, &tail, rows, kq, &h0, &format!("{fmt:?}"));
                check_gated_norm_layer_tail(g, &mut r, &tail, rows, kq, &h0, &format!("{fmt:?}"));
                // norm_matmul_many (q/k/v-like: 3 matrices) == rms_norm + matmul_many.
                let x = g.upload(&rand_vec(&mut r, rows * d, 2.0)).expect("x");
                let ws = [&wq, &wk, &wk];
                let ns = [kq, kq / 4, kq / 4];
                let mut want: Vec<_> = ns.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut xn = poisoned(g, rows * d);
                g.rms_norm(&x, &ln, d, 1e-6, &mut xn).expect("rms_norm");
                let mut refs: Vec<_> = want.iter_mut().collect();
                g.matmul_many(&xn, rows, &ws, &mut refs).expect("many");
                let mut got: Vec<_> = ns.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut xn2 = poisoned(g, rows * d);
                let mut refs: Vec<_> = got.iter_mut().collect();
                g.norm_matmul_many(&x, &ln, d, 1e-6, &mut xn2, rows, &ws, &mut refs)
                    .expect("norm_matmul_many");
                assert!(
                    g.download(&xn2).expect("dl").iter().all(|v| v.is_nan()),
                    "{fmt:?}: norm_matmul_many fell back to the separate ops"
                );
                for i in 0..3 {
                    assert_bits(
                        &format!("{fmt:?} norm_matmul_many d={d} rows={rows} matrix {i}"),
                        &g.download(&got[i]).expect("dl"),
                        &g.download(&want[i]).expect("dl"),
                        ns[i],
                    );
                }
                // More than 3 matrices (a hybrid layer's q / k / v, z, b, a): launches of up to
                // 3 reading the norm's x, the bits of rms_norm + matmul_many.
                let ws5 = [&wq, &wk, &wk, &wq, &wk];
                let ns5 = [kq, kq / 4, kq / 4, kq, kq / 4];
                let mut want5: Vec<_> = ns5.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut refs: Vec<_> = want5.iter_mut().collect();
                g.matmul_many(&xn, rows, &ws5, &mut refs).expect("many 5");
                let mut got5: Vec<_> = ns5.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut xn5 = poisoned(g, rows * d);
                let mut refs: Vec<_> = got5.iter_mut().collect();
                g.norm_matmul_many(&x, &ln, d, 1e-6, &mut xn5, rows, &ws5, &mut refs)
                    .expect("norm_matmul_many 5");
                assert!(
                    g.download(&xn5).expect("dl").iter().all(|v| v.is_nan()),
                    "{fmt:?}: norm_matmul_many of 5 matrices fell back to the separate ops"
                );
                for i in 0..5 {
                    assert_bits(
                        &format!("{fmt:?} norm_matmul_many of 5, d={d} rows={rows} matrix {i}"),
                        &g.download(&got5[i]).expect("dl"),
                        &g.download(&want5[i]).expect("dl"),
                        ns5[i],
                    );
                }
                // The knob off: the separate ops (xn written), the same bits.
                g.set_skinny_producers(false);
                let mut off: Vec<_> = ns.iter().map(|&n| poisoned(g, rows * n)).collect();
                let mut xn3 = poisoned(g, rows * d);
                let mut refs: Vec<_> = off.iter_mut().collect();
                g.norm_matmul_many(&x, &ln, d, 1e-6, &mut xn3, rows, &ws, &mut refs)
                    .expect("norm_matmul_many off");
                g.set_skinny_producers(true);
                assert!(!g.download(&xn3).expect("dl").iter().any(|v| v.is_nan()));
                assert_bits(
                    &format!("{fmt:?} norm_matmul_many (producers off) d={d} rows={rows}"),
                    &g.download(&off[0]).expect("dl"),
                    &g.download(&want[0]).expect("dl"),
                    ns[0],
                );
            }
            // A stale activation: another skinny matmul rewrote the pair; nothing launched.
            let x = g.upload(&rand_vec(&mut r, 4 * d, 1.0)).expect("x");
            let act = g
                .rms_norm_split(&x, &ln, d, 1e-6, 4)
                .expect("rms_norm_split");
            let mut o = poisoned(g, 4 * inter);
            g.matmul(&x, 4, &wg, &mut o).expect("matmul");
            let mut o2 = poisoned(g, 4 * inter);
            assert!(!g
                .matmul_many_split(&act, &[&wg], &mut [&mut o2], false)
                .expect("stale"));
            assert!(g.download(&o2).expect("dl").iter().all(|v| v.is_nan()));
        }
    }
    eprintln!("EXACT bf16 / q8_0 / q4_0 layer_tail, attention_layer_tail (exact / fast / fast over f16 caches) and norm_matmul_many with the skinny producers == the separate ops; stale activations launch nothing");
}

/// A fused tail's `(h, rows before the o projection)` (`res[1]`) against the separate ops'
/// (`res[0]`), bit for bit.
fn assert_fused_tail(what: &str, res: &[(Vec<f32>, Vec<f32>)], d: usize, kq: usize, rows: &str) {
    assert_bits(&format!("{what}: h"), &res[1].0, &res[0].0, d);
    assert_bits(&format!("{what}: {rows}"), &res[1].1, &res[0].1, kq);
}

/// The hybrid layers' tails: `gated_norm_layer_tail` (the gated norm writing the o
/// projection's bf16 hi / lo x) == `rms_norm_gated` + the separate ops of the tail, and
/// `sigmoid_gate_layer_tail` (the output gate writing it) == `mul_sigmoid` + those ops: `h` and
/// the rows before the o projection bit for bit, the fused tail taken (xn unwritten). Heads of
/// 128 (a Gated DeltaNet layer's value heads).
fn check_gated_norm_layer_tail(
    g: &dflash_cuda_kernels::Cuda,
    r: &mut StdRng,
    tail: &dflash_backend::LayerTail<'_, dflash_cuda_kernels::Cuda>,
    rows: usize,
    kq: usize,
    h0: &[f32],
    label: &str,
) {
    use dflash_backend::{layer_tail_ops, GatedNorm};
    let (d, inter, dv) = (tail.wo.rows, tail.w_gate.rows, 128usize);
    let core = g.upload(&rand_vec(r, rows * kq, 1.0)).expect("core");
    let z = g.upload(&rand_vec(r, rows * kq, 2.0)).expect("z");
    let nw = g.upload(&rand_vec(r, dv, 1.0)).expect("norm");
    let gn = GatedNorm {
        x: &core,
        z: &z,
        w: &nw,
        dim: dv,
        eps: 1e-6,
    };
    let mut res = Vec::new();
    for fused in [false, true] {
        let mut h = g.upload(h0).expect("h");
        let mut normed = poisoned(g, rows * kq);
        let mut tb = TailBufs::new(g, rows, d, inter);
        let s = tb.scratch();
        if fused {
            g.gated_norm_layer_tail(&gn, &mut normed, rows, &mut h, tail, s)
                .expect("gated_norm_layer_tail");
            assert!(
                g.download(&tb.xn).expect("dl").iter().all(|v| v.is_nan()),
                "{label}: gated_norm_layer_tail fell back to the separate ops"
            );
        } else {
            g.rms_norm_gated(&core, &z, &nw, dv, 1e-6, &mut normed)
                .expect("rms_norm_gated");
            layer_tail_ops(g, &normed, rows, &mut h, tail, s).expect("ops");
        }
        res.push((
            g.download(&h).expect("dl"),
            g.download(&normed).expect("dl"),
        ));
    }
    assert_fused_tail(
        &format!("{label} gated_norm_layer_tail d={d} rows={rows}"),
        &res,
        d,
        kq,
        "normed",
    );
    // sigmoid_gate_layer_tail (the output gate writing the o projection's x) == mul_sigmoid +
    // the separate ops: `h` and the gated rows bit for bit.
    let gate = g.upload(&rand_vec(r, rows * kq, 3.0)).expect("gate");
    let mut res = Vec::new();
    for fused in [false, true] {
        let mut h = g.upload(h0).expect("h");
        let mut att = g.upload(&g.download(&core).expect("dl")).expect("att");
        let mut tb = TailBufs::new(g, rows, d, inter);
        let s = tb.scratch();
        if fused {
            g.sigmoid_gate_layer_tail(&mut att, &gate, rows, &mut h, tail, s)
                .expect("sigmoid_gate_layer_tail");
            assert!(
                g.download(&tb.xn).expect("dl").iter().all(|v| v.is_nan()),
                "{label}: sigmoid_gate_layer_tail fell back to the separate ops"
            );
        } else {
            g.mul_sigmoid(&mut att, &gate).expect("mul_sigmoid");
            layer_tail_ops(g, &att, rows, &mut h, tail, s).expect("ops");
        }
        res.push((g.download(&h).expect("dl"), g.download(&att).expect("dl")));
    }
    assert_fused_tail(
        &format!("{label} sigmoid_gate_layer_tail d={d} rows={rows}"),
        &res,
        d,
        kq,
        "gated rows",
    );
}

/// `attention_layer_tail` (the attention's combine writing the o projection's activation:
/// Q8_0A8 for A8 weights, the skinny matmuls' bf16 hi / lo for the others) == the attention
/// op + `layer_tail`: h and the attention output, each op (the exact one included), a context
/// of 300 keys + the block, f32 and f16 caches; xn unwritten (the fused tail ran).
fn check_attention_layer_tail(
    g: &dflash_cuda_kernels::Cuda,
    r: &mut StdRng,
    tail: &dflash_backend::LayerTail<'_, dflash_cuda_kernels::Cuda>,
    rows: usize,
    kq: usize,
    h0: &[f32],
    label: &str,
) {
    use dflash_backend::{attention_layer_tail_ops, AttnOp, AttnParams};
    let (d, inter) = (tail.wo.rows, tail.w_gate.rows);
    let (hd, n_ctx) = (128usize, 300usize);
    let (nh, nkv) = (kq / hd, (kq / hd / 4).max(1));
    let n_kv = n_ctx + rows;
    let p = AttnParams {
        n_q: rows,
        n_kv,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        q_pos0: n_ctx,
        kv_pos0: 0,
        causal: false,
        window: None,
        scale: (hd as f32).powf(-0.5),
    };
    let q = g.upload(&rand_vec(r, rows * kq, 1.0)).expect("q");
    let kf = g.upload(&rand_vec(r, n_kv * nkv * hd, 1.0)).expect("k");
    let vf = g.upload(&rand_vec(r, n_kv * nkv * hd, 1.0)).expect("v");
    let (mut k16, mut v16) = (
        poisoned(g, n_kv * nkv * hd / 2),
        poisoned(g, n_kv * nkv * hd / 2),
    );
    g.f16_pack(&kf, &mut k16, 0, n_kv * nkv * hd)
        .expect("pack k");
    g.f16_pack(&vf, &mut v16, 0, n_kv * nkv * hd)
        .expect("pack v");
    for op in [AttnOp::Exact, AttnOp::Fast, AttnOp::FastKv16] {
        let (k, v) = if op == AttnOp::FastKv16 {
            (&k16, &v16)
        } else {
            (&kf, &vf)
        };
        let mut res = Vec::new();
        for fused in [false, true] {
            let mut h = g.upload(h0).expect("h");
            let mut attn_out = poisoned(g, rows * kq);
            let mut tb = TailBufs::new(g, rows, d, inter);
            let s = tb.scratch();
            if fused {
                g.attention_layer_tail(&q, k, v, &p, op, &mut attn_out, &mut h, tail, s)
                    .expect("attention_layer_tail");
                // The fused tail ran (the separate ops would have written xn).
                assert!(
                    g.download(&tb.xn).expect("dl").iter().all(|v| v.is_nan()),
                    "{label} {op:?}: attention_layer_tail fell back to the separate ops"
                );
            } else {
                attention_layer_tail_ops(g, &q, k, v, &p, op, &mut attn_out, &mut h, tail, s)
                    .expect("ops");
            }
            res.push((
                g.download(&h).expect("dl"),
                g.download(&attn_out).expect("dl"),
            ));
        }
        assert_fused_tail(
            &format!("{label} attention_layer_tail {op:?} d={d} rows={rows}"),
            &res,
            d,
            kq,
            "attn",
        );
    }
}

//! `xtask bench gpu --recurrent` and `--hybrid`: the hybrid targets' recurrent ops, and the
//! hybrid target itself, on the GPU.

use std::time::Instant;

use anyhow::{Context, Result};
use dflash_backend::{
    AttnParams, Backend, DeltaParams, HostData, HostWeight, KvStorage, RopeSpec, WeightFormat,
};
use dflash_cuda_kernels::{
    AttnGemm, AttnKernel, Cuda, CudaBuf, PrefillPrecision, DELTA_CHUNK_MIN, SKINNY_ROWS,
};
use dflash_spec_round::{RollbackArm, Target};
use dflash_targets::hybrid::{
    HybridArch, HybridConfig, HybridTarget, LayerKind, TensorNames, TensorSource,
};
use dflash_targets::LoadOptions;
use rayon::prelude::*;

use super::{time_ms, BenchArgs};

/// `--recurrent`: a Gated DeltaNet layer's recurrent ops at the Qwen3.6-27B target's shape
/// per token count, both kernels of each, eager, median of `--iters` (at most 10) device-event
/// timings of one call each; the PyTorch peers beside them.
pub(super) fn recurrent(g: &Cuda, a: &BenchArgs, list: &str) -> Result<()> {
    let ts: Vec<usize> = list
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()?;
    let (nk, nv, dk, dv, ker) = (16usize, 48usize, 128usize, 128usize, 4usize);
    let ch = 2 * nk * dk + nv * dv;
    let iters = a.iters.clamp(1, 10);
    let torch = if a.no_torch {
        Vec::new()
    } else {
        match run_torch_gdn(&ts, [nk, nv, dk, dv, ker], iters) {
            Ok(v) => v,
            Err(e) => {
                println!("PyTorch recurrent ops: {e:#}");
                Vec::new()
            }
        }
    };
    let peer = |t: usize, name: &str| peer_ms(&torch, "t", t, name);
    let fmt = |x: Option<f64>| x.map(|x| format!("{x:.3}")).unwrap_or("-".into());
    let mut phases = String::new();
    let mut md = format!(
        "Gated DeltaNet recurrent ops at the Qwen3.6-27B target's linear-layer shape ({nk} key / {nv} value heads, dk = dv = {dk}, conv kernel {ker} over {ch} channels), f32, {} ({} SMs); one call, eager, median of {iters}; T <= 16 with the per-token stash of a verify. ms.\n\n| T | conv parallel | conv sequential | PyTorch conv | delta rule chunked | delta rule registers | delta rule shared memory | sequential / parallel | PyTorch recurrent | PyTorch chunked | fla recurrent | fla chunk |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        g.context().name()?,
        g.num_sms(),
    );
    for &t in &ts {
        let stash = t <= SKINNY_ROWS;
        let x = g.random_buf(t * ch, 1, 1.0)?;
        let w = g.random_buf(ch * ker, 2, 0.5)?;
        let mut cst = g.random_buf((ker - 1) * ch, 3, 1.0)?;
        let mut cout = g.zeros(t * ch)?;
        let mut cstash = if stash {
            Some(g.zeros(t * (ker - 1) * ch)?)
        } else {
            None
        };
        let q = g.random_buf(t * nk * dk, 4, 1.0)?;
        let k = g.random_buf(t * nk * dk, 5, 1.0)?;
        let v = g.random_buf(t * nv * dv, 6, 1.0)?;
        let (ga, gb) = (g.random_buf(t * nv, 7, 2.0)?, g.random_buf(t * nv, 8, 2.0)?);
        let (alog, dtb) = (g.random_buf(nv, 9, 1.0)?, g.random_buf(nv, 10, 1.0)?);
        let (mut gg, mut beta) = (g.zeros(t * nv)?, g.zeros(t * nv)?);
        g.gdn_gates(&ga, &gb, &alog, &dtb, nv, &mut gg, &mut beta)?;
        let mut st = g.random_buf(nv * dk * dv, 11, 0.1)?;
        let mut out = g.zeros(t * nv * dv)?;
        let mut rstash = if stash {
            Some(g.zeros(t * nv * dk * dv)?)
        } else {
            None
        };
        let p = DeltaParams {
            t,
            n_k_heads: nk,
            n_v_heads: nv,
            dk,
            dv,
            qk_l2norm: true,
            q_scale: (dk as f32).powf(-0.5),
        };
        let mut ms = [[0.0f64; 2]; 2];
        let mut delta = |g: &Cuda| {
            time_ms(g, iters, || {
                Ok(g.gated_delta_rule(
                    &q,
                    &k,
                    &v,
                    &gg,
                    &beta,
                    &p,
                    &mut st,
                    &mut out,
                    rstash.as_mut(),
                )?)
            })
        };
        // The chunked kernels at any length (a call with a stash never takes them).
        let chunked = if stash {
            None
        } else {
            g.set_delta_chunk_min(1);
            let c = delta(g)?;
            // What each of its three launches costs: the time without it (wrong results).
            let mut without = [0.0f64; 3];
            for (i, w) in without.iter_mut().enumerate() {
                g.set_delta_skip(1 << i);
                *w = delta(g)?;
            }
            g.set_delta_skip(0);
            println!(
                "recurrent T {t}: chunked delta rule {c:.3} ms; without prep {:.3}, without state {:.3}, without out {:.3}",
                without[0], without[1], without[2]
            );
            phases += &format!(
                "| {t} | {c:.3} | {:.3} | {:.3} | {:.3} |\n",
                c - without[0],
                c - without[1],
                c - without[2]
            );
            g.set_delta_chunk_min(usize::MAX);
            Some(c)
        };
        for (i, par) in [true, false].into_iter().enumerate() {
            g.set_recurrent_parallel(par);
            ms[0][i] = time_ms(g, iters, || {
                Ok(g.causal_conv1d(&x, t, ch, ker, &w, &mut cst, &mut cout, cstash.as_mut())?)
            })?;
            ms[1][i] = delta(g)?;
        }
        g.set_recurrent_parallel(true);
        g.set_delta_chunk_min(DELTA_CHUNK_MIN);
        println!(
            "recurrent T {t}: conv {:.3} / {:.3} ms, delta rule {} / {:.3} / {:.3} ms (chunked / registers / shared memory)",
            ms[0][0], ms[0][1], fmt(chunked), ms[1][0], ms[1][1]
        );
        md += &format!(
            "| {t} | {:.3} | {:.3} | {} | {} | {:.3} | {:.3} | {:.1}x / {:.1}x | {} | {} | {} | {} |\n",
            ms[0][0],
            ms[0][1],
            fmt(peer(t, "conv")),
            fmt(chunked),
            ms[1][0],
            ms[1][1],
            ms[0][1] / ms[0][0],
            ms[1][1] / ms[1][0],
            fmt(peer(t, "transformers recurrent")),
            fmt(peer(t, "transformers chunked")),
            fmt(peer(t, "fla fused_recurrent")),
            fmt(peer(t, "fla chunk")),
        );
    }
    md += "\nThe chunked delta rule by launch: the call's time less its time without that launch (timing ablations, `Cuda::set_delta_skip`), ms:\n\n| T | chunked | `gdn_chunk_prep` | `gdn_chunk_state` | `gdn_chunk_out` |\n|---:|---:|---:|---:|---:|\n";
    md += &phases;
    println!("\n{md}");
    if let Some(path) = &a.md {
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The `ms` of the peer's entry with `key` == `n` and this `name`.
fn peer_ms(list: &[serde_json::Value], key: &str, n: usize, name: &str) -> Option<f64> {
    list.iter()
        .find(|v| v[key].as_u64() == Some(n as u64) && v["name"].as_str() == Some(name))
        .and_then(|v| v["ms"].as_f64())
}

fn run_torch_gdn(ts: &[usize], shape: [usize; 5], iters: usize) -> Result<Vec<serde_json::Value>> {
    let t: Vec<String> = ts.iter().map(|c| c.to_string()).collect();
    let [nk, nv, dk, dv, ker] = shape;
    let args = [
        ("--t", t.join(",")),
        ("--k-heads", nk.to_string()),
        ("--v-heads", nv.to_string()),
        ("--dk", dk.to_string()),
        ("--dv", dv.to_string()),
        ("--kernel", ker.to_string()),
        ("--iters", iters.to_string()),
    ];
    super::json_list(&super::run_peer("torch_gdn.py", &args)?, "torch_gdn.py")
}

/// Random bf16 tensors made on request (a hybrid target's loader asks for each one once):
/// value i of a tensor is a hash of (its name, i) scaled into [-amp, amp], with amp
/// 1 / sqrt(cols) for matrices; vectors (norms, conv taps, gates) as small values.
struct RandomSource;

fn hash64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Uniform in [-amp, amp] from (seed, i).
fn uniform(seed: u64, i: u64, amp: f32) -> f32 {
    let u =
        (hash64(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 40) as f32 / (1u64 << 24) as f32;
    (2.0 * u - 1.0) * amp
}

impl TensorSource for RandomSource {
    fn has(&self, name: &str) -> bool {
        // The Qwen3.5 layout (separate projections), its own lm_head.
        !name.contains("in_proj_qkvz") && !name.contains("experts")
    }

    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        _precision: Option<WeightFormat>,
    ) -> dflash_targets::Result<HostWeight> {
        let seed = name_seed(name);
        let amp = 1.0 / (cols.max(1) as f32).sqrt();
        let bits: Vec<u16> = (0..(rows * cols) as u64)
            .into_par_iter()
            .map(|i| (uniform(seed, i, amp).to_bits() >> 16) as u16)
            .collect();
        Ok(HostWeight::new(name, rows, cols, HostData::Bf16(bits))?)
    }

    fn values(&self, name: &str, shape: &[usize]) -> dflash_targets::Result<Vec<f32>> {
        let seed = name_seed(name);
        let n: usize = shape.iter().product();
        Ok((0..n as u64).map(|i| uniform(seed, i, 0.1)).collect())
    }

    fn names(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The Qwen3.6-27B target's shape with 4 layers (3 Gated DeltaNet + 1 gated full attention)
/// and a 32768-token vocabulary (the bench times the layers, not the vocabulary tables).
fn hybrid_27b_4_layers() -> HybridConfig {
    let rot = 64; // partial_rotary_factor 0.25 of head_dim 256
    HybridConfig {
        arch: HybridArch::Qwen3_5,
        vocab: 32768,
        hidden: 5120,
        intermediate: 17408,
        n_layers: 4,
        n_heads: 24,
        n_kv_heads: 4,
        head_dim: 256,
        rms_eps: 1e-6,
        rope: RopeSpec {
            inv_freq: (0..rot / 2)
                .map(|i| 1.0f32 / 1e7f32.powf((2 * i) as f32 / rot as f32))
                .collect(),
            attention_scaling: 1.0,
        },
        tie_embeddings: false,
        layer_kinds: vec![
            LayerKind::Linear,
            LayerKind::Linear,
            LayerKind::Linear,
            LayerKind::Full,
        ],
        moe_layers: vec![false; 4],
        moe: None,
        lin_k_heads: 16,
        lin_v_heads: 48,
        lin_dk: 128,
        lin_dv: 128,
        conv_kernel: 4,
        max_positions: 262_144,
    }
}

/// A causal prompt attention of `p` rows over `p` keys at (heads, kv heads, head dim): its
/// parameters, random q / k / v and an output buffer.
fn prompt_attn_inputs(
    g: &Cuda,
    p: usize,
    (nh, nkv, hd): (usize, usize, usize),
) -> Result<(AttnParams, CudaBuf, CudaBuf, CudaBuf, CudaBuf)> {
    let ap = AttnParams {
        n_q: p,
        n_kv: p,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        q_pos0: 0,
        kv_pos0: 0,
        causal: true,
        window: None,
        scale: (hd as f32).powf(-0.5),
    };
    let q = g.random_buf(p * nh * hd, 21, 1.0)?;
    let k = g.random_buf(p * nkv * hd, 22, 1.0)?;
    let v = g.random_buf(p * nkv * hd, 23, 1.0)?;
    let out = g.zeros(p * nh * hd)?;
    Ok((ap, q, k, v, out))
}

/// `--hybrid`: the hybrid target's prefill, decode and verify (see the option), wall-clock
/// milliseconds (each call ends in the host's copy of its argmax), median of `--iters` (the
/// prefill's at most 3).
pub(super) fn hybrid_target(g: &Cuda, a: &BenchArgs, list: &str) -> Result<()> {
    let ps: Vec<usize> = list
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()?;
    let cfg = hybrid_27b_4_layers();
    let iters = a.iters.max(1);
    // The PyTorch peer first (its own process; our weights are not loaded yet).
    let torch = if a.no_torch {
        Vec::new()
    } else {
        let args = [
            ("--p", list.to_string()),
            ("--iters", iters.min(3).to_string()),
        ];
        match super::run_peer("torch_hybrid.py", &args)
            .and_then(|t| super::json_list(&t, "torch_hybrid.py"))
        {
            Ok(v) => v,
            Err(e) => {
                println!("PyTorch hybrid target: {e:#}");
                Vec::new()
            }
        }
    };
    let peer = |p: usize, name: &str| peer_ms(&torch, "p", p, name);
    let fmt = |x: Option<f64>| x.map(|x| format!("{x:.2}")).unwrap_or("-".into());
    // Each decode / verify call advances the context by one (3 warm-up calls each).
    let cap = ps.iter().max().copied().unwrap_or(512) + 2 * (iters + 3) + 2 * SKINNY_ROWS;
    let names = TensorNames {
        prefix: "model.".into(),
        lm_head: "lm_head.weight".into(),
    };
    let opts = LoadOptions {
        precision: None,
        ctx_cap: Some(cap),
        kv_storage: KvStorage::F32,
    };
    let t0 = Instant::now();
    let mut t = HybridTarget::from_source(g, cfg.clone(), &RandomSource, &names, opts)?;
    g.stream().synchronize()?;
    println!(
        "hybrid target loaded in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    t.set_rollback(RollbackArm::Stash);
    let tokens: Vec<u32> = (0..cap as u64)
        .map(|i| (hash64(i) % cfg.vocab as u64) as u32)
        .collect();
    if let Some(pp) = &a.profile_prefill {
        let pp = match pp.as_str() {
            "exact" => PrefillPrecision::Exact,
            "fast" => PrefillPrecision::Fast,
            _ => anyhow::bail!("--profile-prefill {pp:?}: expected exact or fast"),
        };
        g.set_prefill_precision(pp);
        for &p in &ps {
            let prompt = &tokens[..p];
            t.prime(g, prompt, &[])?;
            g.stream().synchronize()?;
            let prof = cudarc::driver::Profiler::new()?;
            t.prime(g, prompt, &[])?;
            g.stream().synchronize()?;
            drop(prof);
            // Then a decode and a verify of 16 from context P, each committing one row (one
            // of each unprofiled first).
            let mut pos = p;
            for profiled in [false, true] {
                for n in [1, SKINNY_ROWS] {
                    let prof = profiled.then(cudarc::driver::Profiler::new).transpose()?;
                    t.verify(g, &tokens[pos..pos + n], pos, &[], false)?;
                    t.commit(g, 1)?;
                    g.stream().synchronize()?;
                    drop(prof);
                    pos += 1;
                }
            }
            println!("hybrid P {p}: one {pp:?} prefill, a decode and a verify16 profiled");
        }
        g.set_prefill_precision(PrefillPrecision::Exact);
        return Ok(());
    }
    let mut md = format!(
        "Hybrid target at the Qwen3.6-27B layer shape, {} layers ({} Gated DeltaNet + {} gated full attention; hidden {}, {}/{} linear heads of {}, {}/{} attention heads of {}, MLP {}), vocabulary {}, bf16 random weights, f32 K / V cache; {} ({} SMs). Wall ms per call, median of {iters} (prefill: of {}); decode (1 token) and verify (16 tokens, stash arm) from context P, each call committing its first row (the verify rolls 15 back from the stash). PyTorch: transformers' Qwen3.5 model at the same shape in bf16 (`tools/bench/torch_hybrid.py`; its Gated DeltaNet through the torch fallbacks, flash-linear-attention not installed), CUDA-event ms, median of {}; its decode from a copy of the prefilled cache, the copy's time taken off.\n\n| P | recurrent kernels | prefill ms | decode ms | verify16 ms | verify16 / decode | PyTorch prefill | PyTorch decode | PyTorch / ours, prefill / decode |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        cfg.n_layers,
        cfg.layer_kinds.iter().filter(|k| **k == LayerKind::Linear).count(),
        cfg.layer_kinds.iter().filter(|k| **k == LayerKind::Full).count(),
        cfg.hidden,
        cfg.lin_k_heads,
        cfg.lin_v_heads,
        cfg.lin_dk,
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        cfg.intermediate,
        cfg.vocab,
        g.context().name()?,
        g.num_sms(),
        iters.min(3),
        iters.min(3),
    );
    for &p in &ps {
        // (recurrent kernels parallel, prefill precision)
        // (recurrent kernels parallel, prefill precision, prompt attention, the decode's and
        // verify's attention on the SIMT split kernel as before the fifty-fourth session)
        for (par, pp, gemm, simt) in [
            (true, PrefillPrecision::Exact, AttnGemm::Fused, false),
            (true, PrefillPrecision::Exact, AttnGemm::Fused, true),
            (true, PrefillPrecision::Fast, AttnGemm::Fused, false),
            (true, PrefillPrecision::Exact, AttnGemm::Bf16x3, false),
            (false, PrefillPrecision::Exact, AttnGemm::Fused, false),
        ] {
            g.set_recurrent_parallel(par);
            g.set_prefill_precision(pp);
            g.set_attn_gemm(gemm);
            g.set_attn_kernel(if simt {
                AttnKernel::Simt
            } else {
                AttnKernel::Auto
            })?;
            let prompt = &tokens[..p];
            let prefill = if simt {
                // (the prompt's rows take the fused kernel either way: not timed again)
                t.prime(g, prompt, &[])?;
                f64::NAN
            } else {
                super::wall_ms(g, iters.min(3), || {
                    t.prime(g, prompt, &[])?;
                    Ok(())
                })?
            };
            g.set_prefill_precision(PrefillPrecision::Exact);
            g.set_attn_gemm(AttnGemm::default());
            let tp = peer(p, "prefill").filter(|_| par);
            if gemm != AttnGemm::Fused {
                // The prompt attention's arithmetic changes no decode or verify row.
                println!("hybrid P {p} parallel, attention products: prefill {prefill:.2} ms");
                md += &format!(
                    "| {p} | parallel, attention as cuBLAS products (`AttnGemm::Bf16x3`) | {prefill:.2} | - | - | - | {} | - | {} |\n",
                    fmt(tp),
                    tp.map(|tp| format!("{:.2}x / -", tp / prefill))
                        .unwrap_or("-".into()),
                );
                continue;
            }
            if pp == PrefillPrecision::Fast {
                // The prefill's precision changes no decode or verify row.
                println!("hybrid P {p} parallel, fast prefill: prefill {prefill:.2} ms");
                let ratio = tp.map(|tp| format!("{:.2}x / -", tp / prefill));
                md += &format!(
                    "| {p} | parallel, `PrefillPrecision::Fast` | {prefill:.2} | - | - | - | {} | - | {} |\n",
                    fmt(tp),
                    ratio.unwrap_or("-".into()),
                );
                continue;
            }
            // Every call commits its first row (a round keeps at least the target's own
            // token): the context grows by one per call.
            let mut pos = p;
            let mut round = |n: usize| -> Result<()> {
                t.verify(g, &tokens[pos..pos + n], pos, &[], false)?;
                t.commit(g, 1)?;
                pos += 1;
                Ok(())
            };
            let dec = super::wall_ms(g, iters, || round(1))?;
            let ver = super::wall_ms(g, iters, || round(SKINNY_ROWS))?;
            g.set_attn_kernel(AttnKernel::Auto)?;
            if simt {
                println!(
                    "hybrid P {p} parallel, SIMT attention: decode {dec:.3} ms, verify16 {ver:.3} ms"
                );
                md += &format!(
                    "| {p} | parallel, decode / verify attention on the SIMT split kernel (`AttnKernel::Simt`) | - | {dec:.3} | {ver:.3} | {:.2}x | - | - | - |\n",
                    ver / dec
                );
                continue;
            }
            let label = if par { "parallel" } else { "sequential" };
            println!(
                "hybrid P {p} {label}: prefill {prefill:.2} ms, decode {dec:.3} ms, verify16 {ver:.3} ms"
            );
            let td = peer(p, "decode").filter(|_| par);
            let ratio = match (tp, td) {
                (Some(tp), Some(td)) => format!("{:.2}x / {:.2}x", tp / prefill, td / dec),
                _ => "-".into(),
            };
            md += &format!(
                "| {p} | {label} | {prefill:.2} | {dec:.3} | {ver:.3} | {:.2}x | {} | {} | {ratio} |\n",
                ver / dec,
                fmt(tp),
                fmt(td),
            );
        }
    }
    g.set_recurrent_parallel(true);
    if a.alloc_ablation {
        md += &format!(
            "\nThe prefill by allocation (the backend's memory pool keeping its freed memory at a synchronization, the default, or none of it as CUDA's default pool does, `Cuda::set_pool_keep`; `Backend::zeros` without its memset, `Cuda::set_zero_fill(false)`, a timing ablation), wall ms, median of {}, two rounds:\n\n| P | pool keeps freed memory | zeros filled | exact | fast |\n|---:|---|---|---:|---:|\n",
            iters.min(3)
        );
        for round in 0..2 {
            for &p in &ps {
                for (keep, fill) in [(false, true), (true, true), (true, false)] {
                    g.set_pool_keep(if keep { u64::MAX } else { 0 })?;
                    g.set_zero_fill(fill);
                    let mut ms = [0.0f64; 2];
                    for (m, pp) in ms
                        .iter_mut()
                        .zip([PrefillPrecision::Exact, PrefillPrecision::Fast])
                    {
                        g.set_prefill_precision(pp);
                        *m = super::wall_ms(g, iters.min(3), || {
                            t.prime(g, &tokens[..p], &[])?;
                            Ok(())
                        })?;
                    }
                    println!(
                        "hybrid P {p} round {round}: pool keeps {keep}, zeros filled {fill}: prefill exact {:.2} ms, fast {:.2} ms",
                        ms[0], ms[1]
                    );
                    md += &format!(
                        "| {p} | {} | {} | {:.2} | {:.2} |\n",
                        if keep { "yes" } else { "no" },
                        if fill { "yes" } else { "no" },
                        ms[0],
                        ms[1]
                    );
                }
            }
        }
        g.set_pool_keep(u64::MAX)?;
        g.set_zero_fill(true);
        g.set_prefill_precision(PrefillPrecision::Exact);
    }
    // The full-attention layer's prompt attention alone (f32 cache): the op the layer runs
    // (the fused kernel, `AttnGemm::Fused`; bf16 hi / lo operands, or f16 under the fast
    // prefill), the same arithmetic as two cuBLAS products around a masked softmax, f32
    // products, the split kernel (the 3xTF32 tensor-core one at head dim 256 since the
    // fifty-fourth session, the SIMT one before), and a head dim of 128 with twice the heads (the same
    // products, the tensor-core prefill kernels).
    md += &format!(
        "\nThe full-attention layer's prompt attention alone (`Backend::attention`, causal, f32 K / V cache), CUDA-event ms, median of {}:\n\n| P | {}/{} heads of {}: fused kernel (`AttnGemm::Fused`), bf16 x3 | fused, f16 (`PrefillPrecision::Fast`) | cuBLAS products, bf16 x3 | cuBLAS products, f16 | f32 products | split kernel (`AttnGemm::Off`: SIMT before the fifty-fourth session, tensor cores since) | {}/{} heads of {} (same products): FlashAttention-2-style |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        iters.min(5),
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        2 * cfg.n_heads,
        2 * cfg.n_kv_heads,
        cfg.head_dim / 2
    );
    for &p in &ps {
        let mut ms = [0.0f64; 7];
        let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let (exact, fast) = (PrefillPrecision::Exact, PrefillPrecision::Fast);
        for (i, (nh, nkv, hd, gemm, precision)) in [
            (nh, nkv, hd, AttnGemm::Fused, exact),
            (nh, nkv, hd, AttnGemm::Fused, fast),
            (nh, nkv, hd, AttnGemm::Bf16x3, exact),
            (nh, nkv, hd, AttnGemm::Bf16x3, fast),
            (nh, nkv, hd, AttnGemm::F32, exact),
            (nh, nkv, hd, AttnGemm::Off, exact),
            (2 * nh, 2 * nkv, hd / 2, AttnGemm::default(), exact),
        ]
        .into_iter()
        .enumerate()
        {
            g.set_attn_gemm(gemm);
            g.set_prefill_precision(precision);
            let (ap, q, k, v, mut out) = prompt_attn_inputs(g, p, (nh, nkv, hd))?;
            ms[i] = time_ms(g, iters.min(5), || {
                Ok(g.attention(&q, &k, &v, &ap, &mut out)?)
            })?;
        }
        g.set_attn_gemm(AttnGemm::default());
        g.set_prefill_precision(exact);
        println!(
            "hybrid P {p}: attention alone {:.2} ms (head dim {}, fused; fused f16 {:.2}, products bf16 x3 {:.2}, f16 {:.2}, f32 {:.2}, split kernel {:.2}), {:.2} ms (head dim {})",
            ms[0],
            cfg.head_dim,
            ms[1],
            ms[2],
            ms[3],
            ms[4],
            ms[5],
            ms[6],
            cfg.head_dim / 2
        );
        md += &format!(
            "| {p} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |\n",
            ms[0], ms[1], ms[2], ms[3], ms[4], ms[5], ms[6]
        );
    }
    // The full-attention layer's decode and verify attention alone: 1 and 16 causal rows at
    // positions P.. over P + rows keys, the tensor-core split kernel (the default at head dim
    // 256 since the fifty-fourth session) against the SIMT split kernel.
    md += &format!(
        "\nThe full-attention layer's decode / verify attention alone (`Backend::attention`, causal rows at positions P.., f32 K / V cache, {}/{} heads of {}; the split + combine), CUDA-event us, median of {}:\n\n| P | decode: tensor cores (3xTF32) | decode: SIMT | verify16: tensor cores | verify16: SIMT |\n|---:|---:|---:|---:|---:|\n",
        cfg.n_heads,
        cfg.n_kv_heads,
        cfg.head_dim,
        iters.max(20)
    );
    for &p in &ps {
        let mut us = [0.0f64; 4];
        for (i, (rows, kernel)) in [
            (1, AttnKernel::Auto),
            (1, AttnKernel::Simt),
            (SKINNY_ROWS, AttnKernel::Auto),
            (SKINNY_ROWS, AttnKernel::Simt),
        ]
        .into_iter()
        .enumerate()
        {
            let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
            let ap = AttnParams {
                n_q: rows,
                n_kv: p + rows,
                q_pos0: p,
                ..prompt_attn_inputs(g, 1, (nh, nkv, hd))?.0
            };
            let q = g.random_buf(rows * nh * hd, 31, 1.0)?;
            let k = g.random_buf((p + rows) * nkv * hd, 32, 1.0)?;
            let v = g.random_buf((p + rows) * nkv * hd, 33, 1.0)?;
            let mut out = g.zeros(rows * nh * hd)?;
            g.set_attn_kernel(kernel)?;
            us[i] = 1e3
                * time_ms(g, iters.max(20), || {
                    Ok(g.attention(&q, &k, &v, &ap, &mut out)?)
                })?;
        }
        g.set_attn_kernel(AttnKernel::Auto)?;
        println!(
            "hybrid P {p}: decode attention {:.1} us (SIMT {:.1}), verify16 {:.1} us (SIMT {:.1})",
            us[0], us[1], us[2], us[3]
        );
        md += &format!(
            "| {p} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            us[0], us[1], us[2], us[3]
        );
    }
    if let Some(list) = &a.pf2_shapes {
        let shapes: Vec<(usize, usize, usize)> = list
            .split(',')
            .map(|e| -> Result<(usize, usize, usize)> {
                let v: Vec<usize> = e
                    .trim()
                    .split(':')
                    .map(|x| x.parse())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("--pf2-shapes entry {e:?}"))?;
                match v[..] {
                    [k, st, r] => Ok((k, st, r)),
                    _ => anyhow::bail!("--pf2-shapes entry {e:?}: expected KEYS:STAGES:ROWS"),
                }
            })
            .collect::<Result<_>>()?;
        md += "\nThe fused prompt attention (`AttnGemm::Fused`) by kernel shape (`Cuda::set_attn_pf2_shape`: keys per chunk, stages, query rows per block; a shape without a kernel times the products), CUDA-event ms:\n\n| P | keys:stages:rows | exact (bf16 x3) | fast (f16) |\n|---:|---|---:|---:|\n";
        for &p in &ps {
            let heads = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
            let (ap, q, k, v, mut out) = prompt_attn_inputs(g, p, heads)?;
            for &(keys, stages, rows) in &shapes {
                g.set_attn_pf2_shape(keys, stages, rows);
                let mut ms = [0.0f64; 2];
                for (i, pp) in [PrefillPrecision::Exact, PrefillPrecision::Fast]
                    .into_iter()
                    .enumerate()
                {
                    g.set_prefill_precision(pp);
                    ms[i] = time_ms(g, iters.min(5), || {
                        Ok(g.attention(&q, &k, &v, &ap, &mut out)?)
                    })?;
                }
                g.set_prefill_precision(PrefillPrecision::Exact);
                println!(
                    "hybrid P {p}: fused attention {keys}:{stages}:{rows} {:.2} ms exact, {:.2} fast",
                    ms[0], ms[1]
                );
                md += &format!(
                    "| {p} | {keys}:{stages}:{rows} | {:.2} | {:.2} |\n",
                    ms[0], ms[1]
                );
            }
            g.set_attn_pf2_shape(0, 0, 0);
        }
    }
    println!("\n{md}");
    if let Some(path) = &a.md {
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

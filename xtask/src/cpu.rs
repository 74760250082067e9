//! `cargo xtask bench cpu`: the CPU backend at a published checkpoint shape, random weights:
//! the dense target's verify at widths 1..16 against its 1-row decode, the drafter's step, its
//! ingest, and from them the projected speedup of speculative decoding at a published
//! acceptance. The shipped toy pair fits in the cache (its decode is compute-bound, see the
//! README); this measures the case the README's "pays where the decode streams its weights"
//! is about, on the same code paths a round runs (`Target::verify`, `Drafter::draft`).

use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use dflash_backend::cpu::Cpu;
use dflash_backend::{Backend, HostWeight, RopeSpec, WeightFormat};
use dflash_draft_model::random::random_tensor_map;
use dflash_draft_model::{DraftConfig, Drafter as DraftModel, LoadOptions, Precision};
use dflash_spec_round::{DflashDrafter, DraftOptions, Drafter, Target};
use dflash_targets::qwen3::Qwen3Config;
use dflash_targets::random::random_qwen3;

#[derive(Args)]
pub struct BenchArgs {
    /// Checkpoint shape: `qwen3-4b` (Qwen3-4B + Qwen3-4B-DFlash-b16) or `qwen3-0.6b` (the
    /// same drafter layout at Qwen3-0.6B's width, a quick run).
    #[arg(long, default_value = "qwen3-4b")]
    pub shape: String,
    /// Backend threads (default: one per logical CPU).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context the target is primed with before the timings.
    #[arg(long, default_value_t = 64)]
    pub ctx: usize,
    /// Timed repetitions of each measurement (the fastest is kept).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Target weight format (`bf16`: the published checkpoints' dtype).
    #[arg(long, default_value = "bf16")]
    pub target_format: String,
    /// Acceptance length (tokens committed per round) the projection assumes. Default: the
    /// published Qwen3-4B-DFlash-b16 tau on GSM8K at temperature 0.
    #[arg(long, default_value_t = 6.5)]
    pub tau: f64,
}

/// Target and drafter shapes of one published pair.
struct Shape {
    name: &'static str,
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    draft_layers: usize,
    taps: [i32; 5],
    block: usize,
}

fn shape(name: &str) -> Result<Shape> {
    Ok(match name {
        // Qwen3-4B (tied embeddings) and z-lab Qwen3-4B-DFlash-b16 (docs: dflash-semantics.md)
        "qwen3-4b" => Shape {
            name: "Qwen3-4B + DFlash-b16",
            vocab: 151936,
            hidden: 2560,
            inter: 9728,
            layers: 36,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            draft_layers: 5,
            taps: [1, 9, 17, 25, 33],
            block: 16,
        },
        "qwen3-0.6b" => Shape {
            name: "Qwen3-0.6B + a 5-layer b16 drafter",
            vocab: 151936,
            hidden: 1024,
            inter: 3072,
            layers: 28,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            draft_layers: 5,
            taps: [1, 7, 13, 19, 25],
            block: 16,
        },
        other => bail!("unknown --shape {other} (qwen3-4b, qwen3-0.6b)"),
    })
}

/// A z-lab DFlash drafter config: `[hidden, layers, heads, kv_heads, head_dim, intermediate,
/// vocab]`, the block, the target layers it taps, and (when not all full attention) the
/// layer types with the sliding window. The mask token is the last id.
pub fn zlab_draft_config(
    dims: [usize; 7],
    block: usize,
    taps: &[i64],
    layer_types: &[&str],
    window: Option<usize>,
) -> Result<DraftConfig> {
    let [hidden, layers, heads, kv_heads, head_dim, inter, vocab] = dims;
    let mut j = serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "block_size": block,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": taps},
    });
    if !layer_types.is_empty() {
        j["layer_types"] = layer_types.into();
        j["sliding_window"] = window.into();
    }
    DraftConfig::from_json_str(&j.to_string()).map_err(|e| anyhow!("{e:?}"))
}

/// Fastest of `reps` runs of `f`, in milliseconds.
fn best_ms(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(best)
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let be = match a.threads {
        Some(n) => Cpu::with_threads(n)?,
        None => Cpu::new(),
    };
    // the whole run on the pool, as the CLI runs a decode loop (see `Cpu::run`)
    be.run(|| bench_on(&be, &a))
}

fn bench_on(be: &Cpu, a: &BenchArgs) -> Result<()> {
    let s = shape(&a.shape)?;
    let tfmt = crate::gpu::parse_format(&a.target_format)?;
    let t0 = Instant::now();
    let half = s.head_dim / 2;
    let cfg = Qwen3Config {
        vocab: s.vocab,
        hidden: s.hidden,
        intermediate: s.inter,
        n_layers: s.layers,
        n_heads: s.heads,
        n_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        rms_eps: 1e-6,
        rope: RopeSpec {
            inv_freq: (0..half)
                .map(|i| 1.0f32 / 1.0e6f32.powf((2 * i) as f32 / s.head_dim as f32))
                .collect(),
            attention_scaling: 1.0,
        },
        tie_embeddings: true,
        windows: vec![None; s.layers],
        max_positions: 40960,
    };
    let cap = a.ctx + 64;
    let mut target = random_qwen3(be, cfg, 1, tfmt, cap)?;
    let dcfg = zlab_draft_config(
        [
            s.hidden,
            s.draft_layers,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.inter,
            s.vocab,
        ],
        s.block,
        &s.taps.map(i64::from),
        &[],
        None,
    )?;
    let map = random_tensor_map(&dcfg, 7);
    let opts = LoadOptions {
        precision: Precision::Q8_0A8,
        ..Default::default()
    };
    let model = DraftModel::from_tensors(be, dcfg, &map, &opts)?;
    drop(map);
    // the CLI's default head: a Q8_0A8 copy of the target's lm_head (random values here: the
    // kernels' cost does not depend on them)
    let head = {
        let v: Vec<f32> = (0..s.vocab * s.hidden)
            .map(|i| ((i.wrapping_mul(2654435761) >> 7) % 255) as f32 / 127.0 - 1.0)
            .collect();
        be.upload_weight(&HostWeight::from_f32(
            "draft_head",
            s.vocab,
            s.hidden,
            &v,
            WeightFormat::Q8_0A8,
        )?)?
    };
    let mut drafter = DflashDrafter::new(&model)?.with_head(head);
    let load_s = t0.elapsed().as_secs_f64();

    let prompt: Vec<u32> = (0..a.ctx as u32)
        .map(|i| (i * 7919 + 11) % s.vocab as u32)
        .collect();
    let taps = drafter.tap_layers().to_vec();
    let t1 = Instant::now();
    target.prime(be, &prompt, &[])?;
    let prime_ms = t1.elapsed().as_secs_f64() * 1e3;
    let widths = [1usize, 2, 4, 8, 12, 16];
    let mut verify = Vec::new();
    for &w in &widths {
        let block: Vec<u32> = prompt.iter().copied().cycle().take(w).collect();
        let tp: &[i32] = if w == 1 { &[] } else { &taps };
        let ms = best_ms(a.reps, || {
            let pos = target.pos();
            target.verify(be, &block, pos, tp, false)?;
            target.commit(be, 1)?;
            // back to the context: every rep runs at the same position
            target.prime_reset_to(a.ctx);
            Ok(())
        })?;
        verify.push((w, ms));
    }
    drafter.reset(be, cap)?;
    let f = target.prime(be, &prompt, &taps)?;
    let tb = f.taps.ok_or_else(|| anyhow!("prime returned no taps"))?;
    drafter.ingest(be, &tb, prompt.len())?;
    let dopts = DraftOptions {
        markov: false,
        emb_scale: 1.0,
    };
    let nd = drafter.n_drafts();
    let draft_ms = best_ms(a.reps, || {
        drafter.draft(be, &target, prompt[a.ctx - 1], a.ctx, nd, dopts)?;
        Ok(())
    })?;
    // a round's ingest: the taps of 8 committed rows (tau ~6.5 + the bonus token)
    let tb8 = be.zeros(8 * taps.len() * s.hidden)?;
    let ingest_ms = best_ms(a.reps, || {
        drafter.ingest(be, &tb8, 8)?;
        Ok(())
    })?;
    let decode = verify[0].1;
    let v16 = verify[verify.len() - 1].1;

    println!(
        "machine: CPU backend, {} threads, {:?}; {} (random weights, target {:?}, drafter Q8_0A8 + Q8_0A8 head), ctx {}, fastest of {}; load {:.0} s, prefill of the context {:.0} ms",
        be.threads(),
        be.isa(),
        s.name,
        tfmt,
        a.ctx,
        a.reps,
        load_s,
        prime_ms
    );
    println!("\n| verify width | ms | over the 1-row decode |");
    println!("|---:|---:|---:|");
    for (w, ms) in &verify {
        println!("| {w} | {ms:.1} | {:.2}x |", ms / decode);
    }
    println!(
        "\ndraft step ({}-row block + {nd} lm_head rows): {draft_ms:.1} ms ({:.2}x the decode)",
        s.block,
        draft_ms / decode
    );
    println!("ingest of 8 rows: {ingest_ms:.2} ms");
    let round = draft_ms + v16 + ingest_ms;
    let plain = a.tau * decode;
    println!(
        "projection (not a measured run) at tau {tau:.2}, the whole block verified: round = draft {draft_ms:.1} + verify16 {v16:.1} + ingest {ingest_ms:.1} = {round:.1} ms against {tau:.2} plain tokens x {decode:.1} ms = {plain:.1} ms: {:.2}x",
        plain / round,
        tau = a.tau,
    );
    Ok(())
}

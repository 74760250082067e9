//! `dflash bench`: speculative vs plain greedy decode over a held-out prompt set, side by side
//! in one process (per prompt: plain then spec, alternating the order over repetitions, the
//! fastest repetition of each kept), with tau, acceptance, tokens/s, speedup, exactness, the
//! machine, and where a round's time goes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_backend::Backend;
use dflash_spec_round::{DraftOptions, Drafter, SpecConfig, Target};
use serde_json::json;

use crate::load::{load_pair, PairSpec};
use crate::machine::Machine;
use crate::run::{first_diff, plain_run, spec_run};
use dflash_spec_round::DflashDrafter;

#[derive(Args)]
pub struct BenchArgs {
    /// Prompt set: JSON lines with `ids` (token ids) or `prompt` (text).
    #[arg(long, default_value = "models/prompts-heldout.jsonl")]
    pub prompts: PathBuf,
    /// Only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Tokens to generate per prompt (every generated token counts).
    #[arg(long, default_value_t = 256)]
    pub max_new: usize,
    /// Timed repetitions per prompt (each of spec and plain); the fastest is kept.
    #[arg(long, default_value_t = 1)]
    pub reps: usize,
    /// Backend threads (0: one per logical CPU). Default: one per core this process may use
    /// (see `generate --help`).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Matmuls (and other ops) below this many multiply-adds run on the calling thread
    /// (default: the backend's own threshold).
    #[arg(long)]
    pub par_min_work: Option<usize>,
    /// Also time the target's verify at several widths and the draft step (where a round's
    /// time goes).
    #[arg(long)]
    pub profile: bool,
    /// One JSON object (one line) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Run the target and the drafter on the CPU or on a CUDA GPU.
    #[arg(long, value_enum, default_value_t = crate::DeviceArg::Cpu)]
    pub device: crate::DeviceArg,
    /// CUDA device ordinal (with `--device cuda`).
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    #[command(flatten)]
    pub common: crate::common::CommonArgs,
}

struct PromptRow {
    idx: usize,
    prompt_len: usize,
    tokens: Vec<u32>,
    plain: Vec<u32>,
    per_round: Vec<usize>,
    stats: dflash_spec_round::Stats,
    spec_s: f64,
    plain_s: f64,
    /// The target's prefill of the prompt alone (no taps), fastest of `reps`: the part of both
    /// runs that speculation cannot change.
    prefill_s: f64,
    stop: String,
}

fn read_prompts(path: &PathBuf, tk: Option<&tokenizers::Tokenizer>) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let ids = if let Some(a) = v.get("ids").and_then(|a| a.as_array()) {
            a.iter()
                .map(|x| {
                    x.as_u64().map(|x| x as u32).with_context(|| {
                        format!("{}:{}: `ids` holds a non-integer", path.display(), i + 1)
                    })
                })
                .collect::<Result<Vec<u32>>>()?
        } else if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            let tk = tk.with_context(|| {
                format!(
                    "{}:{}: a text prompt needs the target's tokenizer.json",
                    path.display(),
                    i + 1
                )
            })?;
            tk.encode(p, false)
                .map_err(|e| anyhow::anyhow!("tokenizing prompt {}: {e}", i + 1))?
                .get_ids()
                .to_vec()
        } else {
            bail!("{}:{}: neither `ids` nor `prompt`", path.display(), i + 1);
        };
        out.push(ids);
    }
    Ok(out)
}

fn ms_per(d: std::time::Duration, n: usize) -> f64 {
    d.as_secs_f64() * 1e3 / n.max(1) as f64
}

pub fn bench(a: BenchArgs) -> Result<()> {
    match a.device {
        crate::DeviceArg::Cpu => {
            a.common.cpu_prefill()?;
            let be = crate::common::cpu_backend(a.threads, a.par_min_work)?;
            be.run(|| bench_on(&be, Machine::cpu(&be), a))
        }
        crate::DeviceArg::Cuda => {
            let be = crate::common::cuda_backend(a.gpu, a.common.prefill)?;
            bench_on(&be, Machine::cuda(&be), a)
        }
    }
}

fn bench_on<B: Backend>(be: &B, machine: Machine, a: BenchArgs) -> Result<()> {
    let c = &a.common;
    let tk = c.tokenizer()?;
    let mut prompts = read_prompts(&a.prompts, tk.as_ref())?;
    if let Some(n) = a.limit {
        prompts.truncate(n);
    }
    if prompts.is_empty() {
        bail!("no prompts in {}", a.prompts.display());
    }
    let eos = c.eos()?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let ctx_cap = c.ctx.unwrap_or(longest + a.max_new + 64);
    let attn = c.draft_attention.on(a.device == crate::DeviceArg::Cuda);
    let mut pair = load_pair(
        be,
        &PairSpec {
            target_dir: c.target_dir(),
            draft_dir: c.draft_dir(),
            target_precision: c.target_format()?,
            draft_precision: c.draft_precision(),
            fast_attention: attn.fast(),
            kv_storage: attn.kv_storage(),
            target_kv_storage: c.target_kv.storage(),
            ctx_cap,
            quiet: a.json,
        },
    )?;
    let cfg = c.spec_config();
    let head = crate::common::draft_head(be, pair.target.as_ref(), c.draft_head)?;
    let mut drafter = crate::common::spec_drafter(&pair.draft, head)?;
    let target = pair.target.as_mut();

    // warm-up (page faults, pools, allocator), not timed
    {
        let p = &prompts[0];
        let n = a.max_new.min(16);
        spec_run(be, target, &mut drafter, cfg, p, &eos, n, |_| Ok(()))?;
        plain_run(be, target, p, &eos, n)?;
    }

    let reps = a.reps.max(1);
    let mut rows = Vec::new();
    for (idx, p) in prompts.iter().enumerate() {
        let mut best_spec: Option<crate::run::SpecRun> = None;
        let mut best_plain: Option<(Vec<u32>, f64)> = None;
        for r in 0..reps {
            // alternate the order so neither side always runs on a warmer cache
            for side in if (idx + r) % 2 == 0 { [0, 1] } else { [1, 0] } {
                if side == 0 {
                    let s = spec_run(
                        be,
                        target,
                        &mut drafter,
                        cfg,
                        p,
                        &eos,
                        a.max_new,
                        |_| Ok(()),
                    )?;
                    if best_spec.as_ref().is_none_or(|b| s.wall_s < b.wall_s) {
                        best_spec = Some(s);
                    }
                } else {
                    let pl = plain_run(be, target, p, &eos, a.max_new)?;
                    if best_plain.as_ref().is_none_or(|b| pl.1 < b.1) {
                        best_plain = Some(pl);
                    }
                }
            }
        }
        let (Some(s), Some((plain, plain_s))) = (best_spec, best_plain) else {
            bail!("internal: no run for prompt {idx}");
        };
        let mut prefill_s = f64::INFINITY;
        for _ in 0..reps {
            let t0 = std::time::Instant::now();
            target.prime(be, p, &[])?;
            prefill_s = prefill_s.min(t0.elapsed().as_secs_f64());
        }
        let row = PromptRow {
            idx,
            prompt_len: p.len(),
            tokens: s.tokens,
            plain,
            per_round: s.per_round,
            stats: s.stats,
            spec_s: s.wall_s,
            plain_s,
            prefill_s,
            stop: format!("{:?}", s.stop),
        };
        if !a.json {
            if idx == 0 {
                println!("machine: {}", machine.describe());
                println!(
                    "pair: {} + {} (drafter {:?}, drafter head {:?}, drafter attention {:?}), max_new {}, verify cap {}, adaptive {} (multiple {}), reps {reps}",
                    c.target_dir().display(),
                    c.draft_dir().display(),
                    c.draft_precision(),
                    c.draft_head,
                    attn,
                    a.max_new,
                    c.verify_cap.map_or("block".to_string(), |v| v.to_string()),
                    !c.no_adaptive,
                    c.verify_multiple
                );
                println!(
                    "{:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>9} {:>9} {:>7} {:>9}",
                    "prompt",
                    "len",
                    "tokens",
                    "rounds",
                    "tau",
                    "acc",
                    "spec t/s",
                    "plain t/s",
                    "speedup",
                    "identical"
                );
            }
            let st = &row.stats;
            println!(
                "{:>6} {:>6} {:>6} {:>6} {:>6.2} {:>6.3} {:>9.1} {:>9.1} {:>6.2}x {:>9}",
                row.idx,
                row.prompt_len,
                row.tokens.len(),
                st.rounds,
                st.tau(),
                st.acceptance(),
                row.tokens.len() as f64 / row.spec_s,
                row.plain.len() as f64 / row.plain_s,
                row.plain_s / row.spec_s,
                row.tokens == row.plain
            );
        }
        rows.push(row);
    }

    // ---- overall
    let rounds: usize = rows.iter().map(|r| r.stats.rounds).sum();
    let committed: usize = rows.iter().map(|r| r.stats.committed).sum();
    let drafted: usize = rows.iter().map(|r| r.stats.drafted).sum();
    let accepted: usize = rows.iter().map(|r| r.stats.accepted).sum();
    let with_rounds: Vec<f64> = rows
        .iter()
        .filter(|r| r.stats.rounds > 0)
        .map(|r| r.stats.tau())
        .collect();
    let tau_pooled = committed as f64 / rounds.max(1) as f64;
    let tau_mean = with_rounds.iter().sum::<f64>() / with_rounds.len().max(1) as f64;
    let spec_tokens: usize = rows.iter().map(|r| r.tokens.len()).sum();
    let plain_tokens: usize = rows.iter().map(|r| r.plain.len()).sum();
    let spec_s: f64 = rows.iter().map(|r| r.spec_s).sum();
    let plain_s: f64 = rows.iter().map(|r| r.plain_s).sum();
    let prefill_s: f64 = rows.iter().map(|r| r.prefill_s).sum();
    // Both runs start with the same target prefill of the prompt; without it, what is left is
    // plain decode against rounds (plus the spec side's own prime extras: taps, drafter ingest).
    let gen_speedup = (plain_s - prefill_s) / (spec_s - prefill_s);
    let identical = rows.iter().filter(|r| r.tokens == r.plain).count();
    let sum = |f: fn(&dflash_spec_round::Stats) -> std::time::Duration| {
        rows.iter()
            .map(|r| f(&r.stats))
            .sum::<std::time::Duration>()
    };
    let (draft_d, verify_d, ingest_d, rollback_d, prime_d) = (
        sum(|s| s.draft),
        sum(|s| s.verify),
        sum(|s| s.ingest),
        sum(|s| s.rollback),
        sum(|s| s.prime),
    );
    let mean_width = (drafted + rounds) as f64 / rounds.max(1) as f64;
    let decode_ms = plain_s * 1e3 / plain_tokens.max(1) as f64;
    let round_ms = ms_per(draft_d + verify_d + ingest_d + rollback_d, rounds);

    let profile = if a.profile {
        Some(profile(be, target, &mut drafter, &prompts[0], cfg)?)
    } else {
        None
    };

    if a.json {
        let per: Vec<_> = rows
            .iter()
            .map(|r| {
                let st = &r.stats;
                json!({
                    "prompt": r.idx,
                    "prompt_tokens": r.prompt_len,
                    "n_tokens": r.tokens.len(),
                    "tokens": r.tokens,
                    "plain_tokens": r.plain,
                    "identical": r.tokens == r.plain,
                    "first_diff": first_diff(&r.tokens, &r.plain),
                    "rounds": st.rounds,
                    "drafted": st.drafted,
                    "accepted": st.accepted,
                    "committed": st.committed,
                    "tau": st.tau(),
                    "acceptance": st.acceptance(),
                    "committed_per_round": r.per_round,
                    "stop": r.stop,
                    "prime_ms": st.prime.as_secs_f64() * 1e3,
                    "draft_ms": st.draft.as_secs_f64() * 1e3,
                    "verify_ms": st.verify.as_secs_f64() * 1e3,
                    "rollback_ms": st.rollback.as_secs_f64() * 1e3,
                    "ingest_ms": st.ingest.as_secs_f64() * 1e3,
                    "spec_ms": r.spec_s * 1e3,
                    "plain_ms": r.plain_s * 1e3,
                    "spec_tok_s": r.tokens.len() as f64 / r.spec_s,
                    "plain_tok_s": r.plain.len() as f64 / r.plain_s,
                    "speedup": r.plain_s / r.spec_s,
                    "prefill_ms": r.prefill_s * 1e3,
                    "speedup_after_prefill": (r.plain_s - r.prefill_s) / (r.spec_s - r.prefill_s),
                })
            })
            .collect();
        let o = json!({
            "machine": machine.json(),
            "target": c.target_dir(),
            "draft": c.draft_dir(),
            "prompts_file": a.prompts,
            "max_new": a.max_new,
            "reps": reps,
            "verify_cap": c.verify_cap,
            "adaptive": !c.no_adaptive,
            "verify_multiple": c.verify_multiple,
            "draft_precision": format!("{:?}", c.draft_precision()),
            "draft_head": format!("{:?}", c.draft_head),
            "draft_attention": format!("{:?}", attn),
            "markov": !c.no_markov,
            "load_ms": pair.load_ms,
            "prompts": rows.len(),
            "rounds": rounds,
            "drafted": drafted,
            "accepted": accepted,
            "committed": committed,
            "tau_pooled": tau_pooled,
            "tau_mean_per_prompt": tau_mean,
            "acceptance": accepted as f64 / drafted.max(1) as f64,
            "spec_tok_s": spec_tokens as f64 / spec_s,
            "plain_tok_s": plain_tokens as f64 / plain_s,
            "speedup": plain_s / spec_s,
            "prefill_ms": prefill_s * 1e3,
            "speedup_after_prefill": gen_speedup,
            "identical": identical,
            "all_identical": identical == rows.len(),
            "round_ms": round_ms,
            "draft_ms_per_round": ms_per(draft_d, rounds),
            "verify_ms_per_round": ms_per(verify_d, rounds),
            "ingest_ms_per_round": ms_per(ingest_d, rounds),
            "mean_verify_rows": mean_width,
            "decode_ms_per_token": decode_ms,
            "prime_ms": prime_d.as_secs_f64() * 1e3,
            "profile": profile.as_ref().map(|p| p.json()),
            "per_prompt": per,
        });
        println!("{o}");
    } else {
        println!(
            "overall: {} prompts, tau pooled {tau_pooled:.2} (mean per prompt {tau_mean:.2}), \
             acceptance {:.3} ({accepted}/{drafted}), spec {:.1} tok/s vs plain {:.1} tok/s: \
             speedup {:.2}x; identical {identical}/{}",
            rows.len(),
            accepted as f64 / drafted.max(1) as f64,
            spec_tokens as f64 / spec_s,
            plain_tokens as f64 / plain_s,
            plain_s / spec_s,
            rows.len()
        );
        println!(
            "per round: draft {:.2} ms + verify {:.2} ms ({mean_width:.1} rows) + ingest {:.2} ms \
             = {round_ms:.2} ms for {tau_pooled:.2} tokens ({:.2} ms/token); plain decode \
             {decode_ms:.2} ms/token (prefill included)",
            ms_per(draft_d, rounds),
            ms_per(verify_d, rounds),
            ms_per(ingest_d, rounds),
            round_ms / tau_pooled.max(1e-9),
        );
        println!(
            "without the target's prefill of the prompt ({:.1} ms per prompt, the same work in both \
             runs): spec {:.1} tok/s vs plain {:.1} tok/s: speedup {gen_speedup:.2}x",
            prefill_s * 1e3 / rows.len().max(1) as f64,
            spec_tokens as f64 / (spec_s - prefill_s),
            plain_tokens as f64 / (plain_s - prefill_s),
        );
        if let Some(p) = &profile {
            p.print();
        }
    }
    if identical != rows.len() {
        bail!(
            "{} prompt(s) where the speculative stream differs from plain greedy",
            rows.len() - identical
        );
    }
    Ok(())
}

/// Micro-timings on one prompt's context: the target's verify at several widths (vs a 1-row
/// decode) and the draft step for several draft counts.
struct Profile {
    ctx: usize,
    verify: Vec<(usize, f64)>,
    draft: Vec<(usize, f64)>,
    ingest: Vec<(usize, f64)>,
}

impl Profile {
    fn json(&self) -> serde_json::Value {
        json!({
            "ctx": self.ctx,
            "verify_ms": self.verify.iter().map(|(w, t)| json!({"rows": w, "ms": t})).collect::<Vec<_>>(),
            "draft_ms": self.draft.iter().map(|(n, t)| json!({"drafts": n, "ms": t})).collect::<Vec<_>>(),
            "ingest_ms": self.ingest.iter().map(|(n, t)| json!({"rows": n, "ms": t})).collect::<Vec<_>>(),
        })
    }

    fn print(&self) {
        let base = self.verify.first().map_or(1.0, |v| v.1);
        let mut s = format!("profile at ctx {}: verify", self.ctx);
        for (w, t) in &self.verify {
            s += &format!(" {w}:{t:.2}ms({:.1}x)", t / base);
        }
        println!("{s}");
        let mut s = "  draft step (16-row block + lm_head rows + argmax):".to_string();
        for (n, t) in &self.draft {
            s += &format!(" n={n}:{t:.2}ms");
        }
        println!("{s}");
        let mut s = "  ingest:".to_string();
        for (n, t) in &self.ingest {
            s += &format!(" {n} rows:{t:.2}ms");
        }
        println!("{s}");
    }
}

fn profile<B: Backend>(
    be: &B,
    target: &mut dyn Target<B>,
    drafter: &mut DflashDrafter<'_, B>,
    prompt: &[u32],
    cfg: SpecConfig,
) -> Result<Profile> {
    const REPS: usize = 30;
    let taps = drafter.tap_layers().to_vec();
    let info = target.info();
    let ctx = prompt.len();
    let mut verify = Vec::new();
    let reps = REPS.min(info.ctx_cap.saturating_sub(ctx + 16)).max(1);
    for w in 1usize..=16 {
        // each width from the same primed prompt; every rep commits one row (dense: a
        // truncation), so the position drifts by at most `reps`
        target.prime(be, prompt, &[])?;
        let block: Vec<u32> = prompt.iter().copied().cycle().take(w).collect();
        let tp: &[i32] = if w == 1 { &[] } else { &taps };
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let pos = target.pos();
            let t0 = Instant::now();
            target.verify(be, &block, pos, tp, false)?;
            best = best.min(t0.elapsed().as_secs_f64() * 1e3);
            target.commit(be, 1)?;
        }
        verify.push((w, best));
    }
    // re-prime both for the draft / ingest timings
    drafter.reset(be, info.ctx_cap)?;
    let f = target.prime(be, prompt, &taps)?;
    let tb = f.taps.context("prime returned no taps")?;
    drafter.ingest(be, &tb, prompt.len())?;
    let mut draft = Vec::new();
    let opts = DraftOptions {
        markov: cfg.markov,
        emb_scale: cfg.emb_scale,
    };
    let nd = drafter.n_drafts();
    for n in 1..=nd {
        let n = n.min(nd);
        let mut best = f64::INFINITY;
        for _ in 0..REPS {
            let t0 = Instant::now();
            drafter.draft(be, &*target, prompt[ctx - 1], ctx, n, opts)?;
            best = best.min(t0.elapsed().as_secs_f64() * 1e3);
        }
        draft.push((n, best));
    }
    let mut ingest = Vec::new();
    let width = taps.len() * info.hidden;
    for n in [1usize, 4, 16] {
        let buf = be.zeros(n * width)?;
        let mut best = f64::INFINITY;
        // the ingests accumulate context rows: stay within the cache
        let room = info.ctx_cap.saturating_sub(ctx + drafter.n_drafts() + 1);
        for _ in 0..(room / 21).min(8) {
            let t0 = Instant::now();
            drafter.ingest(be, &buf, n)?;
            best = best.min(t0.elapsed().as_secs_f64() * 1e3);
        }
        ingest.push((n, best));
    }
    Ok(Profile {
        ctx,
        verify,
        draft,
        ingest,
    })
}

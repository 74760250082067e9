//! `dflash`: lossless block-diffusion speculative decoding from the command line.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use dflash_backend::Backend;
use serde_json::json;

mod bench;
mod common;
mod drafter;
mod load;
mod machine;
mod run;
mod stream;

/// Default model pair (the small trained pair shipped in `models/`).
const DEFAULT_TARGET: &str = "target";
const DEFAULT_DRAFT: &str = "draft";

#[derive(Parser)]
#[command(
    name = "dflash",
    version,
    about = "Lossless block-diffusion speculative decoding (DFlash / DSpark)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate with speculative decoding (optionally compared with plain greedy decode).
    Generate(GenerateArgs),
    /// Speculative vs plain greedy over a held-out prompt set: tau, acceptance, tokens/s,
    /// speedup, exactness, per prompt and overall.
    Bench(bench::BenchArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PrecisionArg {
    F32,
    Bf16,
    #[value(name = "q8_0", alias = "q8")]
    Q8_0,
    #[value(name = "q4_0", alias = "q4")]
    Q4_0,
    Mixed,
    /// q8_0 weights with activations quantized to q8_0 (integer dots: AVX-512 VNNI on the CPU).
    #[value(name = "q8_0a8", alias = "q8a8")]
    Q8_0a8,
    /// q4_0 weights with activations quantized to q8_0 (ggml's q4_0 x q8_0 dot): half the
    /// bytes of q8_0a8 (on CUDA the int8 tensor cores, on the CPU the same integer dot).
    #[value(name = "q4_0a8", alias = "q4a8")]
    Q4_0a8,
}

/// The lm_head the drafter computes its logits with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DraftHeadArg {
    /// The target's own lm_head (its file format).
    Target,
    /// A Q8_0A8 copy of the target's lm_head (integer dots; the target keeps its own).
    #[value(name = "q8_0a8", alias = "q8a8")]
    Q8_0a8,
    /// A Q4_0A8 copy of the target's lm_head (half the bytes of q8_0a8's).
    #[value(name = "q4_0a8", alias = "q4a8")]
    Q4_0a8,
}

/// The drafter's attention arithmetic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DraftAttnArg {
    /// `fast16` on CUDA, `fast` on the CPU.
    Auto,
    /// The exact op (f32 on the CPU, 3xTF32 tensor cores on CUDA).
    Exact,
    /// Reduced-precision products where the backend has them (1xTF32 tensor cores on CUDA;
    /// the CPU runs the exact op): changes what the drafter proposes, never what is committed.
    Fast,
    /// `fast` over a draft KV cache stored in f16: half its memory, and on CUDA f16 tensor
    /// cores fed straight from the cache (the CPU's kernels widen it as they read it).
    Fast16,
}

impl DraftAttnArg {
    /// `Auto` made concrete for the device: an f16 cache on CUDA (H200, q8_0a8 draft step, one
    /// lease: the same at ctx 512, 3-4% faster at 1024-8192, half the cache), `fast` on the
    /// CPU (the shipped pair's draft step 0.76-0.79 ms with an f16 cache against 0.64-0.72 ms,
    /// 2-vCPU Zen 4, `dflash bench --reps 1`, two runs each).
    fn on(self, cuda: bool) -> Self {
        match self {
            DraftAttnArg::Auto if cuda => DraftAttnArg::Fast16,
            DraftAttnArg::Auto => DraftAttnArg::Fast,
            a => a,
        }
    }

    /// The drafter's attention through `Backend::attention_fast` (or its f16-cache twin).
    fn fast(self) -> bool {
        matches!(self, DraftAttnArg::Fast | DraftAttnArg::Fast16)
    }

    /// How the draft KV cache stores K and V.
    fn kv_storage(self) -> dflash_backend::KvStorage {
        match self {
            DraftAttnArg::Fast16 => dflash_backend::KvStorage::F16,
            _ => dflash_backend::KvStorage::F32,
        }
    }
}

/// How the target's K / V cache stores its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum TargetKvArg {
    /// f32, the exact attention.
    F32,
    /// f16: half the cache memory (twice the context in the same memory) and its bytes read;
    /// the attention over the f16 values (on CUDA with f16 products, about bf16 SDPA's
    /// precision). Speculative and plain decode share it: the streams stay identical.
    F16,
}

impl TargetKvArg {
    fn storage(self) -> dflash_backend::KvStorage {
        match self {
            TargetKvArg::F32 => dflash_backend::KvStorage::F32,
            TargetKvArg::F16 => dflash_backend::KvStorage::F16,
        }
    }
}

/// The arithmetic of the target's prefill of the prompt on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PrefillArg {
    /// x split into bf16 hi + lo (two or three products), the attention in 3xTF32: within
    /// 1e-3 of the CPU reference.
    Exact,
    /// One bf16 product per matmul and the attention in 1xTF32 (a bf16 engine's prefill;
    /// CUDA only). Speculative and plain decode share the prefill: the streams stay identical.
    Fast,
}

impl PrefillArg {
    fn precision(self) -> dflash_cuda_kernels::PrefillPrecision {
        match self {
            PrefillArg::Exact => dflash_cuda_kernels::PrefillPrecision::Exact,
            PrefillArg::Fast => dflash_cuda_kernels::PrefillPrecision::Fast,
        }
    }
}

/// Where the target and the drafter run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DeviceArg {
    /// The CPU backend (the reference; AVX-512 / AVX2 kernels where the CPU has them).
    Cpu,
    /// The CUDA backend (NVRTC kernels, loaded at run time: needs the CUDA driver and NVRTC).
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ArmArg {
    Stash,
    Replay,
    Gate,
}

#[derive(Args)]
struct GenerateArgs {
    /// Prompt text (tokenized with tokenizer.json from the target directory).
    #[arg(conflicts_with_all = ["prompt", "prompt_ids"])]
    text: Option<String>,
    /// Prompt text (same as the positional argument).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate (every generated token counts, the first included).
    #[arg(long, default_value_t = 128)]
    max_new: usize,
    /// Also run plain greedy decode and compare the two streams (the default without --json).
    #[arg(long)]
    compare_plain: bool,
    /// Without --json: skip the plain greedy comparison.
    #[arg(long, conflicts_with = "compare_plain")]
    spec_only: bool,
    /// Print one JSON object (one line) instead of text.
    #[arg(long)]
    json: bool,
    /// Backend threads (0: one per logical CPU). Default: one per core this process may use
    /// (hardware threads of one core add nothing to these compute-bound kernels).
    #[arg(long)]
    threads: Option<usize>,
    /// Run the target and the drafter on the CPU or on a CUDA GPU.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    device: DeviceArg,
    /// CUDA device ordinal (with `--device cuda`).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    #[command(flatten)]
    common: common::CommonArgs,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Generate(a) => generate(a),
        Cmd::Bench(a) => bench::bench(a),
    }
}

/// A default model directory: `models/<name>` under the working directory, else under the
/// source checkout the binary was built from.
fn default_dir(name: &str) -> PathBuf {
    let local = PathBuf::from("models").join(name);
    if local.exists() {
        return local;
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join(name);
    if built.exists() {
        built
    } else {
        local
    }
}

fn eos_from_config(dir: &Path) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for file in ["config.json", "generation_config.json"] {
        let p = dir.join(file);
        if !p.exists() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)
            .with_context(|| format!("parsing {}", p.display()))?;
        let v = v
            .get("text_config")
            .and_then(|t| t.get("eos_token_id"))
            .or_else(|| v.get("eos_token_id"));
        match v {
            Some(serde_json::Value::Number(n)) => out.extend(n.as_u64().map(|x| x as u32)),
            Some(serde_json::Value::Array(a)) => {
                out.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32))
            }
            _ => {}
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

fn generate(a: GenerateArgs) -> Result<()> {
    match a.device {
        DeviceArg::Cpu => {
            a.common.cpu_prefill()?;
            let be = common::cpu_backend(a.threads, None)?;
            be.run(|| generate_on(&be, a))
        }
        DeviceArg::Cuda => {
            let be = common::cuda_backend(a.gpu, a.common.prefill)?;
            generate_on(&be, a)
        }
    }
}

fn generate_on<B: Backend>(be: &B, a: GenerateArgs) -> Result<()> {
    let c = &a.common;
    let target_dir = c.target_dir();
    let text = a.text.clone().or(a.prompt.clone());
    let tokenizer = c.tokenizer()?;
    let prompt: Vec<u32> = match (&a.prompt_ids, &text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(t)) => {
            let tk = tokenizer.as_ref().with_context(|| {
                format!(
                    "--prompt needs {}",
                    target_dir.join("tokenizer.json").display()
                )
            })?;
            tk.encode(t.as_str(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
                .get_ids()
                .to_vec()
        }
        (None, None) => {
            bail!("give a prompt: positional TEXT, --prompt TEXT or --prompt-ids 1,2,3")
        }
    };
    let eos = c.eos()?;

    let ctx_cap = c.ctx.unwrap_or(prompt.len() + a.max_new + 64);
    let attn = c.draft_attention.on(a.device == DeviceArg::Cuda);
    let pair = load::load_pair(
        be,
        &load::PairSpec {
            target_dir,
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
    let load_ms = pair.load_ms;
    let mut target = pair.target;
    let head = common::draft_head(be, target.as_ref(), c.draft_head)?;
    let mut drafter = common::spec_drafter(&pair.draft, head)?;
    let cfg = c.spec_config();

    // ---- warm-up, untimed and not shown (page faults, scratch buffers, allocator pools), so
    // that neither timed run pays the first-touch costs: a few tokens of each
    let compare = a.compare_plain || (!a.json && !a.spec_only);
    {
        let n = a.max_new.min(8);
        run::spec_run(
            be,
            target.as_mut(),
            &mut drafter,
            cfg,
            &prompt,
            &eos,
            n,
            |_| Ok(()),
        )?;
        if compare {
            run::plain_run(be, target.as_mut(), &prompt, &eos, n)?;
        }
    }

    // ---- speculative run, the text streamed round by round when printing text
    let mut stdout = std::io::stdout();
    let mut text_stream = match (&tokenizer, a.json) {
        (Some(tk), false) => {
            if let Some(t) = &text {
                write!(stdout, "{t}")?;
                stdout.flush()?;
            }
            Some(stream::TextStream::new(tk))
        }
        _ => None,
    };
    let run = run::spec_run(
        be,
        target.as_mut(),
        &mut drafter,
        cfg,
        &prompt,
        &eos,
        a.max_new,
        |ids| {
            if let Some(ts) = text_stream.as_mut() {
                write!(stdout, "{}", ts.push(ids)?)?;
                stdout.flush()?;
            }
            Ok(())
        },
    )?;
    if let Some(ts) = text_stream.as_mut() {
        write!(stdout, "{}", ts.finish()?)?;
    }
    let stream_text = text_stream.is_some();
    let (tokens, stats, spec_s) = (run.tokens, run.stats, run.wall_s);

    // ---- plain greedy reference (same target, same kernels): by default when printing text
    let plain = if compare {
        Some(run::plain_run(
            be,
            target.as_mut(),
            &prompt,
            &eos,
            a.max_new,
        )?)
    } else {
        None
    };
    let identical = plain.as_ref().map(|(p, _)| *p == tokens);
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let decode_s = spec_s - stats.prime.as_secs_f64();
    if a.json {
        let mut o = json!({
            "prompt_tokens": prompt.len(),
            "tokens": tokens,
            "n_tokens": tokens.len(),
            "rounds": stats.rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "tau": stats.tau(),
            "acceptance": stats.acceptance(),
            "first_draft": stats.first_draft,
            "prime_ms": ms(stats.prime),
            "draft_ms": ms(stats.draft),
            "verify_ms": ms(stats.verify),
            "rollback_ms": ms(stats.rollback),
            "ingest_ms": ms(stats.ingest),
            "spec_ms": spec_s * 1e3,
            "spec_tok_per_s": tokens.len() as f64 / decode_s.max(1e-9),
            "load_ms": load_ms,
        });
        if plain.is_some() {
            // end to end (prefill included) on both sides, like plain_tok_per_s
            o["spec_tok_s"] = json!(tokens.len() as f64 / spec_s.max(1e-9));
        }
        if let Some(tk) = &tokenizer {
            o["text"] = json!(tk
                .decode(&tokens, false)
                .map_err(|e| anyhow::anyhow!("decode: {e}"))?);
        }
        if let Some((p, s)) = &plain {
            o["plain_tokens"] = json!(p);
            o["identical"] = json!(identical);
            o["plain_ms"] = json!(s * 1e3);
            o["plain_tok_per_s"] = json!(p.len() as f64 / s.max(1e-9));
            o["plain_tok_s"] = json!(p.len() as f64 / s.max(1e-9));
            o["speedup"] = json!(s / spec_s.max(1e-9));
        }
        println!("{o}");
    } else {
        if !stream_text {
            println!("tokens: {tokens:?}");
        } else {
            println!();
        }
        println!(
            "--\ntau {:.2} ({} rounds, {}/{} drafts accepted, {:.1}%)",
            stats.tau(),
            stats.rounds,
            stats.accepted,
            stats.drafted,
            100.0 * stats.acceptance()
        );
        println!(
            "spec  {:7.1} tok/s ({} tokens in {:.3} s, prefill included)",
            tokens.len() as f64 / spec_s.max(1e-9),
            tokens.len(),
            spec_s
        );
        if let Some((p, s)) = &plain {
            println!(
                "plain {:7.1} tok/s ({} tokens in {:.3} s, same target and kernels)",
                p.len() as f64 / s.max(1e-9),
                p.len(),
                s
            );
            println!(
                "speedup {:.2}x; streams identical: {}",
                s / spec_s.max(1e-9),
                if identical == Some(true) { "yes" } else { "NO" }
            );
        }
    }
    if identical == Some(false) {
        bail!("the speculative stream differs from plain greedy decode");
    }
    Ok(())
}

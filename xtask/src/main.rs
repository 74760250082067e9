//! `cargo xtask ...`: developer tasks that need Python peers, fixtures or long runs.
//!
//! Each area lives in its own module (`quant.rs`, ...) and registers its subcommands under
//! `parity` and `bench` here. The Python interpreter is `$DFLASH_PYTHON` if set, else
//! `python3`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod cpu;
mod gpu;
mod oracle;
mod quant;
mod regs;

#[derive(Parser)]
#[command(name = "xtask", about = "dflash-rs developer tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Live comparisons with independent Python implementations.
    Parity {
        #[command(subcommand)]
        what: ParityCmd,
    },
    /// Benchmarks, with the peer measured side by side in the same run.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Registers and spills of every kernel as ptxas compiles them (no GPU: NVRTC + ptxas).
    Regs(regs::RegsArgs),
}

#[derive(Subcommand)]
enum ParityCmd {
    /// q8_0 / q4_0 / bf16 / f16 encoders against gguf==0.19.0 on fresh random blocks.
    Quant(quant::ParityArgs),
    /// Drafter fixtures: regenerate with the Python oracle, self-check, run the fixture tests on them.
    Draft(oracle::FixtureArgs),
    /// Target fixtures (transformers Qwen3 / Qwen3.5): same, for dflash-targets.
    Targets(oracle::FixtureArgs),
    /// The oracle's greedy speculative loop vs the Rust engine (`dflash bench`), prompt by prompt: streams, rounds, tau.
    Spec(oracle::SpecArgs),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Encode / decode throughput of every format, 1 thread and all threads, vs gguf-py.
    Quant(quant::BenchArgs),
    /// The draft step on the CUDA backend vs PyTorch, HBM floor, verify vs decode (GPU machine).
    Gpu(Box<gpu::BenchArgs>),
    /// Verify vs decode, the draft step and the projected speedup on the CPU backend at a
    /// published checkpoint shape (random weights).
    Cpu(cpu::BenchArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Parity { what } => match what {
            ParityCmd::Quant(a) => quant::parity(a),
            ParityCmd::Draft(a) => oracle::parity_draft(a),
            ParityCmd::Targets(a) => oracle::parity_targets(a),
            ParityCmd::Spec(a) => oracle::parity_spec(a),
        },
        Cmd::Bench { what } => match what {
            BenchCmd::Quant(a) => quant::bench(a),
            BenchCmd::Gpu(a) => gpu::bench(*a),
            BenchCmd::Cpu(a) => cpu::bench(a),
        },
        Cmd::Regs(a) => regs::regs(a),
    }
}

/// The repository root (the parent of this crate's directory).
pub fn repo_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// The Python interpreter: `$DFLASH_PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("DFLASH_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".to_string())
}

/// Runs `python script args...` from the repository root; returns its stdout.
pub fn run_python(script: &str, args: &[String]) -> Result<String> {
    let py = python();
    let root = repo_root();
    let out = Command::new(&py)
        .arg(root.join(script))
        .args(args)
        .current_dir(&root)
        .output()
        .with_context(|| {
            format!("running {py} {script} (set DFLASH_PYTHON to choose the interpreter)")
        })?;
    if !out.status.success() {
        bail!(
            "{py} {script} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A scratch directory under the system temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("dflash-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(Scratch(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

//! Pair, policy and precision flags of `dflash bench` (the same meaning as `generate`'s).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use dflash_backend::{Backend, Weight, WeightFormat};
use dflash_draft_model::Precision;
use dflash_spec_round::{RollbackArm, SpecConfig, Target};

use crate::{
    ArmArg, DraftAttnArg, DraftHeadArg, PrecisionArg, PrefillArg, TargetKvArg, DEFAULT_DRAFT,
    DEFAULT_TARGET,
};

/// Drafter precision of `generate` and `bench` unless `--draft-precision` says otherwise.
/// Q8_0A8 with its Q8_0A8 head: on the 2-core AVX-512 VNNI Xeon, `dflash bench --threads 1
/// --reps 2` (40 prompts x 256) gives draft 0.95 ms per round vs 1.68 ms with f32 and the
/// target's bf16 head, speedup 1.29x vs 1.02x, tau 4.62 vs 4.65, 40/40 identical either way.
pub const DEFAULT_DRAFT_PRECISION: PrecisionArg = PrecisionArg::Q8_0a8;
/// Drafter lm_head unless `--draft-head` says otherwise.
pub const DEFAULT_DRAFT_HEAD: DraftHeadArg = DraftHeadArg::Q8_0a8;
/// Drafter attention unless `--draft-attention` says otherwise: the fast op (the same as the
/// exact one on the CPU; on CUDA, where the drafter's activations are int8 already, over an
/// f16 draft KV cache: f16 tensor cores fed straight from it).
pub const DEFAULT_DRAFT_ATTENTION: DraftAttnArg = DraftAttnArg::Auto;

#[derive(Args)]
pub struct CommonArgs {
    /// Target checkpoint directory (HF layout). Default: models/target.
    #[arg(long)]
    pub target: Option<PathBuf>,
    /// Drafter checkpoint directory (HF layout). Default: models/draft.
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Most rows per verify (anchor + drafts); default: the whole block.
    #[arg(long)]
    pub verify_cap: Option<usize>,
    /// Keep the verify width fixed at the cap.
    #[arg(long)]
    pub no_adaptive: bool,
    /// Round the adaptive verify width (and the drafts computed) up to a multiple of this:
    /// the CPU matmul runs 8- and 4-row tiles, so 4/8/12/16-row verifies are the cheap ones
    /// (1: exactly m + 2).
    #[arg(long, default_value_t = 4)]
    pub verify_multiple: usize,
    /// Ignore the drafter's Markov head.
    #[arg(long)]
    pub no_markov: bool,
    /// Rollback arm for hybrid targets.
    #[arg(long, value_enum, default_value_t = ArmArg::Stash)]
    pub rollback: ArmArg,
    /// Extra EOS ids (the target config's eos_token_id is always used).
    #[arg(long, value_delimiter = ',')]
    pub eos: Vec<u32>,
    /// Ignore the target config's eos_token_id.
    #[arg(long)]
    pub no_eos: bool,
    /// Drafter weight precision.
    #[arg(long, value_enum, default_value_t = DEFAULT_DRAFT_PRECISION)]
    pub draft_precision: PrecisionArg,
    /// The lm_head the drafter's logits use (the target always uses its own).
    #[arg(long, value_enum, default_value_t = DEFAULT_DRAFT_HEAD)]
    pub draft_head: DraftHeadArg,
    /// The drafter's attention arithmetic.
    #[arg(long, value_enum, default_value_t = DEFAULT_DRAFT_ATTENTION)]
    pub draft_attention: DraftAttnArg,
    /// Re-encode the target's matrices (default: keep the file's format).
    #[arg(long, value_enum)]
    pub target_precision: Option<PrecisionArg>,
    /// How the target's K / V cache stores its values.
    #[arg(long, value_enum, default_value_t = TargetKvArg::F32)]
    pub target_kv: TargetKvArg,
    /// The arithmetic of the target's prefill of the prompt (`fast`: CUDA only).
    #[arg(long, value_enum, default_value_t = PrefillArg::Exact)]
    pub prefill: PrefillArg,
    /// Context capacity in positions (default: the (longest) prompt + max_new + 64).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Multiply the borrowed embedding rows by this (gemma-class targets: sqrt(hidden)).
    #[arg(long, default_value_t = 1.0)]
    pub emb_scale: f32,
}

impl CommonArgs {
    pub fn target_dir(&self) -> PathBuf {
        self.target
            .clone()
            .unwrap_or_else(|| crate::default_dir(DEFAULT_TARGET))
    }

    pub fn draft_dir(&self) -> PathBuf {
        self.draft
            .clone()
            .unwrap_or_else(|| crate::default_dir(DEFAULT_DRAFT))
    }

    /// The target directory's `tokenizer.json`, when there is one.
    pub fn tokenizer(&self) -> Result<Option<tokenizers::Tokenizer>> {
        let p = self.target_dir().join("tokenizer.json");
        if !p.exists() {
            return Ok(None);
        }
        tokenizers::Tokenizer::from_file(&p)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("loading {}: {e}", p.display()))
    }

    pub fn eos(&self) -> Result<Vec<u32>> {
        let mut eos = if self.no_eos {
            Vec::new()
        } else {
            crate::eos_from_config(&self.target_dir())?
        };
        eos.extend(&self.eos);
        Ok(eos)
    }

    /// `--prefill fast` is CUDA's alone: an error on the CPU (whose prefill is the exact
    /// reference), not a silent no-op.
    pub fn cpu_prefill(&self) -> Result<()> {
        if self.prefill == PrefillArg::Fast {
            anyhow::bail!(
                "--prefill fast: the CPU backend's prefill is exact only (use --device cuda)"
            );
        }
        Ok(())
    }

    /// The target's `--target-precision` (None: keep the file's format).
    pub fn target_format(&self) -> Result<Option<WeightFormat>> {
        self.target_precision.map(target_format).transpose()
    }

    pub fn draft_precision(&self) -> Precision {
        draft_precision(self.draft_precision)
    }

    pub fn spec_config(&self) -> SpecConfig {
        SpecConfig {
            verify_cap: self.verify_cap,
            adaptive: !self.no_adaptive,
            verify_multiple: self.verify_multiple,
            markov: !self.no_markov,
            rollback: match self.rollback {
                ArmArg::Stash => RollbackArm::Stash,
                ArmArg::Replay => RollbackArm::Replay,
                ArmArg::Gate => RollbackArm::Gate,
            },
            emb_scale: self.emb_scale,
            stats: true,
        }
    }
}

/// The storage format `--target-precision` re-encodes the target's matrices in. `mixed` is a
/// drafter policy (bf16 attention, q8_0 MLP) with no target counterpart: an error, not a
/// silent q8_0.
pub fn target_format(p: PrecisionArg) -> Result<WeightFormat> {
    Ok(match p {
        PrecisionArg::F32 => WeightFormat::F32,
        PrecisionArg::Bf16 => WeightFormat::Bf16,
        PrecisionArg::Q8_0 => WeightFormat::Q8_0,
        PrecisionArg::Q4_0 => WeightFormat::Q4_0,
        PrecisionArg::Q8_0a8 => WeightFormat::Q8_0A8,
        PrecisionArg::Q4_0a8 => WeightFormat::Q4_0A8,
        PrecisionArg::Mixed => anyhow::bail!(
            "--target-precision mixed: `mixed` is a drafter policy (bf16 attention, q8_0 MLP); \
             the target takes one format: f32, bf16, q8_0, q4_0, q8_0a8 or q4_0a8"
        ),
    })
}

pub fn draft_precision(p: PrecisionArg) -> Precision {
    match p {
        PrecisionArg::F32 => Precision::F32,
        PrecisionArg::Bf16 => Precision::Bf16,
        PrecisionArg::Q8_0 => Precision::Q8_0,
        PrecisionArg::Q4_0 => Precision::Q4_0,
        PrecisionArg::Mixed => Precision::Mixed,
        PrecisionArg::Q8_0a8 => Precision::Q8_0A8,
        PrecisionArg::Q4_0a8 => Precision::Q4_0A8,
    }
}

/// The drafter's own lm_head for `--draft-head` (`None`: it borrows the target's).
pub fn draft_head<B: Backend>(
    be: &B,
    target: &dyn Target<B>,
    arg: DraftHeadArg,
) -> Result<Option<Weight<B>>> {
    match arg {
        DraftHeadArg::Target => Ok(None),
        DraftHeadArg::Q8_0a8 => Ok(Some(crate::drafter::reencode_head(
            be,
            target.lm_head(),
            WeightFormat::Q8_0A8,
        )?)),
        DraftHeadArg::Q4_0a8 => Ok(Some(crate::drafter::reencode_head(
            be,
            target.lm_head(),
            WeightFormat::Q4_0A8,
        )?)),
    }
}

/// Backend threads of `generate` and `bench` without `--threads`: one per core this process
/// may use, that is the logical CPUs it may run on (`available_parallelism`: affinity and
/// cgroup quota) over the hardware threads per core (Linux sysfs; 1 where unknown). A second
/// hardware thread of a core adds no FMA throughput to these compute-bound kernels; a second
/// core does (2-core AMD EPYC, the loop on the pool: `dflash bench` 1.32-1.43x faster plain
/// decode and 1.45-1.52x faster spec with 2 threads than with 1).
pub fn default_threads() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    (logical / smt_width()).max(1)
}

/// Hardware threads per core: the size of CPU 0's sibling list, 1 when sysfs does not say.
fn smt_width() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
        .ok()
        .and_then(|l| cpu_list_len(&l))
        .unwrap_or(1)
        .max(1)
}

/// The number of CPUs in a Linux CPU list (`0-1`, `0,64`, `3`, `0-1,8-9`); `None` if malformed.
fn cpu_list_len(list: &str) -> Option<usize> {
    list.trim()
        .split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                b.checked_sub(a).map(|d| d + 1)
            }
            None => part.trim().parse::<usize>().ok().map(|_| 1),
        })
        .sum()
}

/// The CPU backend with `threads` threads (`None`: [`default_threads`]; 0: one per logical
/// CPU) and an optional parallel-work threshold. Drive the decode loop through
/// [`dflash_backend::cpu::Cpu::run`] so that its ops fork inside the pool.
pub fn cpu_backend(
    threads: Option<usize>,
    par_min_work: Option<usize>,
) -> anyhow::Result<dflash_backend::cpu::Cpu> {
    let mut be = match threads.unwrap_or_else(default_threads) {
        0 => dflash_backend::cpu::Cpu::new(),
        n => dflash_backend::cpu::Cpu::with_threads(n)?,
    };
    if let Some(w) = par_min_work {
        be = be.with_par_min_work(w);
    }
    Ok(be)
}

/// The round engine's DFlash drafter over `model`, with `head` in place of the target's
/// lm_head when given (`--draft-head`).
pub fn spec_drafter<'d, B: Backend>(
    model: &'d dflash_draft_model::Drafter<B>,
    head: Option<Weight<B>>,
) -> anyhow::Result<dflash_spec_round::DflashDrafter<'d, B>> {
    let d = dflash_spec_round::DflashDrafter::new(model)?;
    Ok(match head {
        Some(h) => d.with_head(h),
        None => d,
    })
}

/// The CUDA backend on device `ordinal` (the driver and NVRTC are loaded at run time: a
/// machine without them gets an error naming what is missing), its prefill as `prefill` says.
pub fn cuda_backend(
    ordinal: usize,
    prefill: PrefillArg,
) -> anyhow::Result<dflash_cuda_kernels::Cuda> {
    let be = dflash_cuda_kernels::Cuda::new(ordinal)
        .map_err(|e| anyhow::anyhow!("opening CUDA device {ordinal}: {e}"))?;
    be.set_prefill_precision(prefill.precision());
    Ok(be)
}

#[cfg(test)]
mod tests {
    use super::cpu_list_len;

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list_len("0\n"), Some(1));
        assert_eq!(cpu_list_len("0-1\n"), Some(2));
        assert_eq!(cpu_list_len("0,64"), Some(2));
        assert_eq!(cpu_list_len("0-1,8-9"), Some(4));
        assert_eq!(cpu_list_len("4-3"), None);
        assert_eq!(cpu_list_len("a"), None);
        assert_eq!(cpu_list_len(""), None);
    }
}

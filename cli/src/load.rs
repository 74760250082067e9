//! Loading the target + drafter pair behind a progress spinner (stderr; hidden with `--json`
//! or when stderr is not a terminal).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use dflash_backend::{Backend, WeightFormat};
use dflash_draft_model::{Drafter as DraftModel, LoadOptions as DraftLoad, Precision};
use dflash_spec_round::Target;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// What to load and how.
pub struct PairSpec {
    pub target_dir: PathBuf,
    pub draft_dir: PathBuf,
    /// Re-encode the target's matrices (`None`: keep the file's format).
    pub target_precision: Option<WeightFormat>,
    pub draft_precision: Precision,
    /// The drafter's attention through `Backend::attention_fast`.
    pub fast_attention: bool,
    /// How the draft KV cache stores K and V (f16 needs `fast_attention`).
    pub kv_storage: dflash_backend::KvStorage,
    /// How the target's K / V cache stores its values.
    pub target_kv_storage: dflash_backend::KvStorage,
    /// Context capacity of the target (positions).
    pub ctx_cap: usize,
    /// No progress display.
    pub quiet: bool,
}

/// The loaded pair.
pub struct Pair<B: Backend> {
    pub target: Box<dyn Target<B>>,
    pub draft: DraftModel<B>,
    pub load_ms: f64,
}

/// Bytes of the `*.safetensors` files of a checkpoint directory.
pub fn checkpoint_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// A bar over the checkpoint bytes (one step per checkpoint: the loaders do not report
/// progress inside a file), with a steady spinner so a long load shows it is alive.
fn bar(total: u64, quiet: bool) -> ProgressBar {
    let pb = if quiet {
        ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden())
    } else {
        ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
    };
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {msg} [{bar:24}] {binary_bytes}/{binary_total_bytes} {elapsed}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    if !quiet {
        pb.enable_steady_tick(Duration::from_millis(100));
    }
    pb
}

/// Load the target and the drafter on the backend `be`.
pub fn load_pair<B: Backend>(be: &B, spec: &PairSpec) -> Result<Pair<B>> {
    let t0 = Instant::now();
    let tb = checkpoint_bytes(&spec.target_dir);
    let db = checkpoint_bytes(&spec.draft_dir);
    let pb = bar(tb + db, spec.quiet);
    pb.set_message(format!("loading target {}", spec.target_dir.display()));
    let target = dflash_targets::load_target(
        be,
        &spec.target_dir,
        dflash_targets::LoadOptions {
            precision: spec.target_precision,
            ctx_cap: Some(spec.ctx_cap),
            kv_storage: spec.target_kv_storage,
        },
    )
    .with_context(|| format!("loading the target from {}", spec.target_dir.display()))?;
    pb.inc(tb);
    pb.set_message(format!("loading drafter {}", spec.draft_dir.display()));
    let opts = DraftLoad {
        precision: spec.draft_precision,
        fast_attention: spec.fast_attention,
        kv_storage: spec.kv_storage,
        ..DraftLoad::default()
    };
    let draft = DraftModel::<B>::load(be, &spec.draft_dir, &opts)
        .with_context(|| format!("loading the drafter from {}", spec.draft_dir.display()))?;
    pb.inc(db);
    pb.finish_and_clear();
    Ok(Pair {
        target,
        draft,
        load_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}

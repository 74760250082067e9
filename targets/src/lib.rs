//! Reference targets behind [`dflash_spec_round::Target`]: Qwen3 dense (rollback = truncate
//! the KV cache) and the Qwen3.5-style hybrid with Gated DeltaNet layers.

pub mod checkpoint;
pub mod config;
mod error;
pub mod hybrid;
pub mod qwen3;
pub mod random;

pub use error::{Result, TargetError};
pub use qwen3::{unused_tensors, HostTensor, LoadOptions, LogitRows, Qwen3Config, Qwen3Dense};

use dflash_backend::Backend;
use dflash_spec_round::Target;

/// Load a target checkpoint directory behind `dyn Target`, dispatching on the config's
/// `architectures` / `model_type`.
pub fn load_target<B: Backend>(
    be: &B,
    dir: impl AsRef<std::path::Path>,
    opts: LoadOptions,
) -> Result<Box<dyn Target<B>>> {
    let dir = dir.as_ref();
    let ck = checkpoint::Checkpoint::open(dir)?;
    let v = ck.config();
    let arch = v
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str())
        .unwrap_or("");
    let model_type = v.get("model_type").and_then(|m| m.as_str()).unwrap_or("");
    match (arch, model_type) {
        ("Qwen3ForCausalLM", _) | ("", "qwen3") => {
            let cfg = Qwen3Config::from_cfg(&config::Cfg::new(ck.config_path(), v))?;
            Ok(Box::new(Qwen3Dense::from_checkpoint(
                be,
                &ck,
                cfg,
                "model.",
                "lm_head.weight",
                opts,
            )?))
        }
        (_, "qwen3_5" | "qwen3_5_text" | "qwen3_next" | "qwen3_5_moe" | "qwen3_5_moe_text") => Ok(
            Box::new(hybrid::HybridTarget::from_checkpoint(be, &ck, opts)?),
        ),
        _ => Err(TargetError::Unsupported(format!(
            "{}: architecture `{arch}` (model_type `{model_type}`) has no reference target",
            ck.config_path()
        ))),
    }
}

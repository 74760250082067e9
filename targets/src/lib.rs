//! Reference targets behind [`dflash_spec_round::Target`]: Qwen3 dense (rollback = truncate
//! the KV cache) and the Qwen3.5-style hybrid with Gated DeltaNet layers.

pub mod checkpoint;
pub mod config;
mod error;
pub mod hybrid;
pub mod qwen3;
pub mod random;

pub use error::{Result, TargetError};
pub use qwen3::{HostTensor, LoadOptions, LogitRows, Qwen3Config, Qwen3Dense};

use dflash_backend::BackendError;
use thiserror::Error;

/// Errors of the round engine and of the targets behind [`crate::Target`].
#[derive(Debug, Error)]
pub enum SpecError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("token id {id} at {what} index {index} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange {
        what: &'static str,
        index: usize,
        id: u32,
        vocab: usize,
    },
    #[error("context cap exceeded: {what} needs {needed} positions, the target holds {cap}")]
    ContextCap {
        what: &'static str,
        needed: usize,
        cap: usize,
    },
    #[error("drafter hidden size {draft} differs from the target hidden size {target}")]
    HiddenMismatch { draft: usize, target: usize },
    #[error("drafter vocabulary/lm_head width {draft} differs from the target's {target}")]
    VocabMismatch { draft: usize, target: usize },
    #[error(
        "tap layer {layer} is invalid for a target of {n_layers} layers (allowed: -1..={max})"
    )]
    TapLayer {
        layer: i32,
        n_layers: usize,
        max: i64,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("rollback gate: {0}")]
    Gate(String),
    #[error("target: {0}")]
    Target(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("drafter: {0}")]
    Drafter(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, SpecError>;

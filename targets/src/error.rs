use dflash_backend::BackendError;
use dflash_spec_round::SpecError;
use thiserror::Error;

/// Errors of the reference targets: checkpoints, configs, shapes, protocol misuse.
#[derive(Debug, Error)]
pub enum TargetError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("io error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {msg}")]
    Config { path: String, msg: String },
    #[error("safetensors {path}: {msg}")]
    SafeTensors { path: String, msg: String },
    #[error("tensor `{name}` not found in the checkpoint")]
    MissingTensor { name: String },
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}`: unsupported dtype {dtype}")]
    Dtype { name: String, dtype: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Spec(#[from] SpecError),
}

impl From<TargetError> for SpecError {
    fn from(e: TargetError) -> Self {
        match e {
            TargetError::Spec(s) => s,
            TargetError::Backend(b) => SpecError::Backend(b),
            other => SpecError::Target(Box::new(other)),
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, TargetError>;

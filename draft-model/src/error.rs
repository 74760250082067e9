use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong while configuring, loading or running a drafter.
///
/// Bad input (a checkpoint, a config, a token id, a length) is always one of these values,
/// never a panic. Messages name the file / tensor / key, the expected and the found value.
#[derive(Debug, Error)]
pub enum DraftError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid JSON in {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("config: missing key `{0}`")]
    MissingKey(String),
    #[error("config: invalid value for `{key}`: {msg}")]
    InvalidConfig { key: String, msg: String },
    #[error("config: unsupported {what}: `{value}`")]
    Unsupported { what: String, value: String },
    #[error("safetensors file {path}: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("tensor `{tensor}`: unsupported dtype {dtype}")]
    Dtype { tensor: String, dtype: String },
    #[error("tensor `{0}` is missing from the checkpoint")]
    MissingTensor(String),
    #[error("tensor `{tensor}`: expected shape {expected:?}, found {found:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("DSpark-class checkpoint has tensors this drafter does not consume: {0:?}")]
    UnknownTensors(Vec<String>),
    #[error("tensor `{tensor}`: non-finite value {value} at flat index {index}")]
    NonFinite {
        tensor: String,
        index: usize,
        value: f32,
    },
    #[error("tensor `{tensor}`: cannot encode in {format}: {msg}")]
    Encode {
        tensor: String,
        format: String,
        msg: String,
    },
    #[error("token id {id} is out of range for a vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("{what}: expected {expected}, found {found}")]
    Mismatch {
        what: String,
        expected: usize,
        found: usize,
    },
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("backend: {0}")]
    Backend(#[from] dflash_backend::BackendError),
    #[error("draft KV cache: {0}")]
    Kv(#[from] dflash_kv::KvError),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, DraftError>;

impl DraftError {
    pub(crate) fn mismatch(what: impl Into<String>, expected: usize, found: usize) -> Self {
        DraftError::Mismatch {
            what: what.into(),
            expected,
            found,
        }
    }
}

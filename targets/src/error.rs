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

/// The input checks every target forward makes before touching state: a non-empty block that
/// fits under the context cap, token ids inside the vocabulary, and tap layers in `-1..n_layers`.
pub(crate) fn check_forward_input(
    tokens: &[u32],
    start: usize,
    cap: usize,
    vocab: usize,
    taps: &[i32],
    n_layers: usize,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(SpecError::Protocol("forward of zero tokens".into()).into());
    }
    if start + tokens.len() > cap {
        return Err(SpecError::ContextCap {
            what: "forward",
            needed: start + tokens.len(),
            cap,
        }
        .into());
    }
    if let Some((index, &id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(SpecError::TokenOutOfRange {
            what: "forward token",
            index,
            id,
            vocab,
        }
        .into());
    }
    if let Some(&layer) = taps.iter().find(|&&l| l < -1 || l >= n_layers as i32) {
        return Err(SpecError::TapLayer {
            layer,
            n_layers,
            max: n_layers as i64 - 1,
        }
        .into());
    }
    Ok(())
}

/// The verify protocol shared by the targets: a verify starts at the committed length and
/// only after the previous verify was committed.
pub(crate) fn check_verify_start(
    start: usize,
    committed: usize,
    pending: bool,
) -> dflash_spec_round::Result<()> {
    if start != committed || pending {
        return Err(SpecError::Protocol(format!(
            "verify at {start} with {committed} committed positions{}",
            if pending {
                " and an uncommitted verify"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

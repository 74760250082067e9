use thiserror::Error;

/// Errors of the compute seam. Shape errors name the op, the operand, the expected and the
/// found size; device errors carry the backend's own error.
#[derive(Debug, Error)]
pub enum BackendError {
    #[error("{op}: operand `{operand}` has {found} values, expected {expected}")]
    Shape {
        op: &'static str,
        operand: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("{op}: invalid argument: {msg}")]
    Invalid { op: &'static str, msg: String },
    #[error("gather_rows: token id {id} out of range for a table of {rows} rows")]
    TokenOutOfRange { id: u32, rows: usize },
    #[error("weight: {0}")]
    Weight(String),
    #[error("quantization: {0}")]
    Quant(#[from] dflash_quant::QuantError),
    #[error("device error: {0}")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl BackendError {
    /// Shorthand used by shape checks.
    pub fn shape(op: &'static str, operand: &'static str, expected: usize, found: usize) -> Self {
        BackendError::Shape {
            op,
            operand,
            expected,
            found,
        }
    }
}

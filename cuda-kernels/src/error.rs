use dflash_backend::BackendError;
use thiserror::Error;

/// Errors of the CUDA backend. Driver, NVRTC and cuBLAS errors are wrapped as they come.
#[derive(Debug, Error)]
pub enum CudaError {
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC: {0}")]
    Compile(#[from] cudarc::nvrtc::CompileError),
    #[error("cuBLAS: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// The CUDA driver library (libcuda) or NVRTC could not be loaded on this machine.
    #[error("{lib} is not available on this machine")]
    LibraryMissing { lib: &'static str },
    #[error("no CUDA device with ordinal {ordinal} ({count} found)")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("{op}: unsupported: {msg}")]
    Unsupported { op: &'static str, msg: String },
}

impl From<CudaError> for BackendError {
    fn from(e: CudaError) -> Self {
        BackendError::Device(Box::new(e))
    }
}

/// Shorthand: `.map_err(dev)?` on cudarc results inside backend ops.
pub(crate) fn dev<E: Into<CudaError>>(e: E) -> BackendError {
    BackendError::from(e.into())
}

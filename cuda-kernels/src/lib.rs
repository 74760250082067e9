//! CUDA kernels for dflash-rs and the CUDA backend.
//!
//! Kernels are CUDA C sources under `kernels/`, embedded with `include_str!` and compiled by
//! NVRTC for the device's compute capability at first use ([`registry`]). [`Cuda`] implements
//! [`dflash_backend::Backend`] over cudarc with dynamic loading: this crate builds everywhere,
//! and [`Cuda::new`] returns an error (never panics) where no CUDA driver or device exists.
//!
//! Per-row determinism (the Backend contract) holds for every op with at most
//! [`SKINNY_ROWS`] rows, and for all row counts with `CudaOptions { cublas_prefill: false }`:
//! matmul splits, attention splits and reduction trees depend on the shapes of the weights
//! and the context, never on the number of rows.

mod backend;
mod error;
pub mod registry;

pub use backend::{
    a8_split_kernel_shapes, A8Act, A8Kernel, AttnFa, AttnGemm, AttnKernel, Cuda, CudaBuf,
    CudaOptions, CudaWeightBuf, PrefillPrecision, SplitAct, A8_PREFILL_ROWS, ATTN_PREFILL_SPLIT,
    DELTA_CHUNK_MIN, QUANT_PREFILL_ROWS, SKINNY_ROWS, UNPACK_VALUES,
};
pub use error::CudaError;

//! ggml-exact host codecs: q8_0, q4_0, bf16 and f16 rows.
//!
//! Every encoder writes the same bytes as ggml's reference quantizers
//! (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, `ggml_fp32_to_bf16_row_ref`, and the
//! IEEE round-to-nearest-even f16 conversion) built for x86-64, for every finite input,
//! including the cases where naive ports differ: round half away from zero for q8_0, a true
//! division for `d` and the reciprocal taken from the unrounded `d`, the first-occurrence
//! signed max and the separate `+ 8.5` add for q4_0, the `-0.0` scale of an all-zero q4_0
//! block, f16-subnormal and f16-overflow scales (stored as subnormal / ±Inf, codes computed
//! from the f32 reciprocal), and f32-subnormal inputs (a scale below 2^-128 has an infinite
//! reciprocal, and x86's float -> int conversion then stores code 0 for every element).
//!
//! Non-finite inputs and rows whose length is not a multiple of [`QK`] are rejected with a
//! [`QuantError`] naming the element index. Nothing in this crate panics on input.
//!
//! On x86-64 with AVX2 and F16C (detected at run time) the hot loops are vectorised; the
//! portable scalar kernels are used elsewhere. Both produce identical bytes. Large inputs
//! are split over the rayon pool; every block is independent, so the bytes never depend on
//! the number of threads.
//!
//! ```
//! use dflash_quant::{dequantize_row_q8_0, quantize_q8_0, QK};
//!
//! let x: Vec<f32> = (0..2 * QK).map(|i| (i as f32 - 31.5) / 8.0).collect();
//! let q = quantize_q8_0(&x)?; // 2 blocks, 34 bytes each on disk
//! let mut y = vec![0.0f32; x.len()];
//! dequantize_row_q8_0(&q, &mut y)?;
//! let d = q[0].d.to_f32();
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= d));
//! assert!(quantize_q8_0(&x[..40]).is_err()); // not whole blocks
//! # Ok::<(), dflash_quant::QuantError>(())
//! ```
//!
//! On an error, the `*_into` / `*_row_*` forms leave their output buffer in an unspecified
//! (but initialised) state.
//!
//! One documented divergence of the Python port `gguf` 0.19.0 (used as the test oracle):
//! for an all-zero q4_0 block whose first element is `-0.0` it stores `d = +0.0` (`0x0000`)
//! where ggml's C code (and this crate) store `-0.0` (`0x8000`).

use bytemuck::{Pod, Zeroable};
use half::f16;
use rayon::prelude::*;
use thiserror::Error;

mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Values per block for q8_0 and q4_0.
pub const QK: usize = 32;

/// A q8_0 block: 32 signed 8-bit codes and an f16 scale (`value = code * d`). 34 bytes.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// A q4_0 block: 32 4-bit codes and an f16 scale (`value = (code - 8) * d`). 18 bytes.
/// Byte `j` holds element `j` in its low nibble and element `j + 16` in its high nibble.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() == 2);
const _: () = assert!(std::mem::align_of::<BlockQ4_0>() == 2);

/// GGUF tensor type ids (`enum ggml_type`) of the formats this crate handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(clippy::upper_case_acronyms)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q8_0 = 8,
    BF16 = 30,
}

impl GgmlType {
    /// All the types of this crate.
    pub const ALL: [GgmlType; 5] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::BF16,
    ];

    /// The GGUF type id.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// The type with GGUF id `id`.
    pub fn from_id(id: u32) -> Result<Self, QuantError> {
        Self::ALL
            .into_iter()
            .find(|t| t.id() == id)
            .ok_or(QuantError::UnknownType { id })
    }

    /// ggml's type name (`"q8_0"`, `"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::BF16 => "bf16",
        }
    }

    /// Values per block (1 for the plain float types).
    pub const fn block_size(self) -> usize {
        match self {
            GgmlType::Q4_0 | GgmlType::Q8_0 => QK,
            _ => 1,
        }
    }

    /// Bytes per block.
    pub const fn type_size(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => std::mem::size_of::<BlockQ4_0>(),
            GgmlType::Q8_0 => std::mem::size_of::<BlockQ8_0>(),
        }
    }

    /// Bytes taken by a row of `n` values (an error if `n` is not a whole number of blocks).
    pub fn row_bytes(self, n: usize) -> Result<usize, QuantError> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(QuantError::Length { len: n, block: bs });
        }
        Ok(n / bs * self.type_size())
    }
}

impl TryFrom<u32> for GgmlType {
    type Error = QuantError;
    fn try_from(id: u32) -> Result<Self, QuantError> {
        Self::from_id(id)
    }
}

#[derive(Debug, Error, Clone, PartialEq)]
pub enum QuantError {
    /// A NaN or ±Inf input; `index` is the first such element.
    #[error("non-finite value {value} at element {index}")]
    NonFinite { index: usize, value: f32 },
    /// The row does not split into whole blocks; the partial block starts at element
    /// `len - len % block` (see [`QuantError::element_index`]).
    #[error(
        "row length {len} is not a multiple of {block}: the {} elements from element {} \
         do not fill a block",
        len.checked_rem(*block).unwrap_or(0),
        len - len.checked_rem(*block).unwrap_or(0)
    )]
    Length { len: usize, block: usize },
    /// A byte buffer that does not hold a whole number of elements.
    #[error("byte length {len} is not a multiple of {elem} bytes")]
    ByteLength { len: usize, elem: usize },
    /// An output (or input) buffer whose length does not match the other operand.
    #[error("{what}: expected {expected} elements, found {found}")]
    BufferLength {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    /// A GGUF type id this crate does not handle.
    #[error("unknown or unsupported ggml type id {id}")]
    UnknownType { id: u32 },
}

impl QuantError {
    /// The element the error points at: the first non-finite value, or the first element of
    /// the incomplete trailing block.
    pub fn element_index(&self) -> Option<usize> {
        match *self {
            QuantError::NonFinite { index, .. } => Some(index),
            QuantError::Length { len, block } if block > 0 => Some(len - len % block),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Dispatch

#[inline]
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

macro_rules! dispatch {
    ($name:ident, $($arg:expr),*) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if simd() {
                // SAFETY: `simd()` checked AVX2 and F16C on this CPU.
                unsafe { x86::$name($($arg),*) }
            } else {
                scalar::$name($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            scalar::$name($($arg),*)
        }
    }};
}

/// Blocks (or values, for the 16-bit formats: `PAR_CHUNK * QK`) per rayon task.
const PAR_CHUNK: usize = 1024;

fn first_non_finite(x: &[f32]) -> QuantError {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => QuantError::NonFinite {
            index,
            value: x[index],
        },
        // Unreachable when a kernel reported a non-finite value; kept as a value, not a panic.
        None => QuantError::NonFinite {
            index: x.len(),
            value: f32::NAN,
        },
    }
}

fn check_len(x: &[f32], block: usize) -> Result<(), QuantError> {
    if !x.len().is_multiple_of(block) {
        return Err(QuantError::Length {
            len: x.len(),
            block,
        });
    }
    Ok(())
}

fn check_out(what: &'static str, expected: usize, found: usize) -> Result<(), QuantError> {
    if expected != found {
        return Err(QuantError::BufferLength {
            what,
            expected,
            found,
        });
    }
    Ok(())
}

/// Runs `f` over matching chunks of `x` (`per` values per output item), on the rayon pool
/// when the input is large. Returns false if any chunk reported a non-finite value.
fn encode_chunks<T: Send>(
    x: &[f32],
    out: &mut [T],
    per: usize,
    f: impl Fn(&[f32], &mut [T]) -> bool + Sync,
) -> bool {
    let chunk = if per == 1 { PAR_CHUNK * QK } else { PAR_CHUNK };
    if out.len() <= 2 * chunk {
        return f(x, out);
    }
    x.par_chunks(chunk * per)
        .zip(out.par_chunks_mut(chunk))
        .all(|(xc, oc)| f(xc, oc))
}

fn decode_chunks<T: Sync>(
    b: &[T],
    out: &mut [f32],
    per: usize,
    f: impl Fn(&[T], &mut [f32]) + Sync,
) {
    let chunk = if per == 1 { PAR_CHUNK * QK } else { PAR_CHUNK };
    if b.len() <= 2 * chunk {
        return f(b, out);
    }
    b.par_chunks(chunk)
        .zip(out.par_chunks_mut(chunk * per))
        .for_each(|(bc, oc)| f(bc, oc));
}

// ---------------------------------------------------------------------------------------
// q8_0

fn q8_0_kernel(x: &[f32], out: &mut [BlockQ8_0]) -> bool {
    dispatch!(q8_0_row, x, out)
}

fn q4_0_kernel(x: &[f32], out: &mut [BlockQ4_0]) -> bool {
    dispatch!(q4_0_row, x, out)
}

/// Quantize `x` (length a multiple of 32) to q8_0 blocks; parallel for large inputs.
pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<BlockQ8_0>, QuantError> {
    check_len(x, QK)?;
    let mut out = bytemuck::zeroed_vec(x.len() / QK);
    quantize_q8_0_into(x, &mut out)?;
    Ok(out)
}

/// Quantize `x` into `out` (`out.len() == x.len() / 32`); parallel for large inputs.
pub fn quantize_q8_0_into(x: &[f32], out: &mut [BlockQ8_0]) -> Result<(), QuantError> {
    check_len(x, QK)?;
    check_out("q8_0 output blocks", x.len() / QK, out.len())?;
    if encode_chunks(x, out, QK, q8_0_kernel) {
        Ok(())
    } else {
        Err(first_non_finite(x))
    }
}

/// Quantize one row on the calling thread (no rayon), for callers that parallelise
/// themselves. Same bytes as [`quantize_q8_0_into`].
pub fn quantize_row_q8_0(x: &[f32], out: &mut [BlockQ8_0]) -> Result<(), QuantError> {
    check_len(x, QK)?;
    check_out("q8_0 output blocks", x.len() / QK, out.len())?;
    if q8_0_kernel(x, out) {
        Ok(())
    } else {
        Err(first_non_finite(x))
    }
}

/// Dequantize q8_0 blocks. Lenient form kept for existing callers: decodes the
/// `min(b.len(), out.len() / 32)` blocks both buffers have room for and leaves the rest of
/// `out` untouched. Use [`try_dequantize_q8_0`] to get an error on a length mismatch.
pub fn dequantize_q8_0(b: &[BlockQ8_0], out: &mut [f32]) {
    let n = b.len().min(out.len() / QK);
    decode_chunks(&b[..n], &mut out[..n * QK], QK, dq8_0_kernel);
}

/// Dequantize q8_0 blocks into `out` (`out.len() == 32 * b.len()`); parallel for large inputs.
pub fn try_dequantize_q8_0(b: &[BlockQ8_0], out: &mut [f32]) -> Result<(), QuantError> {
    check_out("q8_0 dequantize output", b.len() * QK, out.len())?;
    decode_chunks(b, out, QK, dq8_0_kernel);
    Ok(())
}

/// Dequantize one q8_0 row on the calling thread (the matmul inner loop):
/// `out.len() == 32 * b.len()`.
#[inline]
pub fn dequantize_row_q8_0(b: &[BlockQ8_0], out: &mut [f32]) -> Result<(), QuantError> {
    check_out("q8_0 dequantize output", b.len() * QK, out.len())?;
    dq8_0_kernel(b, out);
    Ok(())
}

fn dq8_0_kernel(b: &[BlockQ8_0], out: &mut [f32]) {
    dispatch!(dq8_0_row, b, out)
}

// ---------------------------------------------------------------------------------------
// q4_0

/// Quantize `x` (length a multiple of 32) to q4_0 blocks; parallel for large inputs.
pub fn quantize_q4_0(x: &[f32]) -> Result<Vec<BlockQ4_0>, QuantError> {
    check_len(x, QK)?;
    let mut out = bytemuck::zeroed_vec(x.len() / QK);
    quantize_q4_0_into(x, &mut out)?;
    Ok(out)
}

/// Quantize `x` into `out` (`out.len() == x.len() / 32`); parallel for large inputs.
pub fn quantize_q4_0_into(x: &[f32], out: &mut [BlockQ4_0]) -> Result<(), QuantError> {
    check_len(x, QK)?;
    check_out("q4_0 output blocks", x.len() / QK, out.len())?;
    if encode_chunks(x, out, QK, q4_0_kernel) {
        Ok(())
    } else {
        Err(first_non_finite(x))
    }
}

/// Quantize one row on the calling thread (no rayon). Same bytes as [`quantize_q4_0_into`].
pub fn quantize_row_q4_0(x: &[f32], out: &mut [BlockQ4_0]) -> Result<(), QuantError> {
    check_len(x, QK)?;
    check_out("q4_0 output blocks", x.len() / QK, out.len())?;
    if q4_0_kernel(x, out) {
        Ok(())
    } else {
        Err(first_non_finite(x))
    }
}

/// Dequantize q4_0 blocks. Lenient form kept for existing callers: decodes the
/// `min(b.len(), out.len() / 32)` blocks both buffers have room for and leaves the rest of
/// `out` untouched. Use [`try_dequantize_q4_0`] to get an error on a length mismatch.
pub fn dequantize_q4_0(b: &[BlockQ4_0], out: &mut [f32]) {
    let n = b.len().min(out.len() / QK);
    decode_chunks(&b[..n], &mut out[..n * QK], QK, dq4_0_kernel);
}

/// Dequantize q4_0 blocks into `out` (`out.len() == 32 * b.len()`); parallel for large inputs.
pub fn try_dequantize_q4_0(b: &[BlockQ4_0], out: &mut [f32]) -> Result<(), QuantError> {
    check_out("q4_0 dequantize output", b.len() * QK, out.len())?;
    decode_chunks(b, out, QK, dq4_0_kernel);
    Ok(())
}

/// Dequantize one q4_0 row on the calling thread (the matmul inner loop):
/// `out.len() == 32 * b.len()`.
#[inline]
pub fn dequantize_row_q4_0(b: &[BlockQ4_0], out: &mut [f32]) -> Result<(), QuantError> {
    check_out("q4_0 dequantize output", b.len() * QK, out.len())?;
    dq4_0_kernel(b, out);
    Ok(())
}

fn dq4_0_kernel(b: &[BlockQ4_0], out: &mut [f32]) {
    dispatch!(dq4_0_row, b, out)
}

/// A q4_0 block as the q8_0 block of the same values: the codes `code - 8` (in -8..=7) with
/// the same scale, so `dequantize_q8_0` of the result gives exactly `dequantize_q4_0`'s values
/// (both compute `code * d` in f32). What ggml's `vec_dot_q4_0_q8_0` multiplies with the
/// activation's q8_0 codes.
pub fn widen_q4_0(b: &BlockQ4_0) -> BlockQ8_0 {
    let mut qs = [0i8; QK];
    for (j, &byte) in b.qs.iter().enumerate() {
        qs[j] = (byte & 0x0f) as i8 - 8;
        qs[j + QK / 2] = (byte >> 4) as i8 - 8;
    }
    BlockQ8_0 { d: b.d, qs }
}

// ---------------------------------------------------------------------------------------
// bf16 / f16

fn bf16_kernel(x: &[f32], out: &mut [u16]) -> bool {
    dispatch!(bf16_row, x, out)
}

fn f16_kernel(x: &[f32], out: &mut [u16]) -> bool {
    dispatch!(f16_row, x, out)
}

fn dbf16_kernel(b: &[u16], out: &mut [f32]) {
    dispatch!(dbf16_row, b, out)
}

fn df16_kernel(b: &[u16], out: &mut [f32]) {
    dispatch!(df16_row, b, out)
}

/// f32 -> bf16 bit patterns, round to nearest even (ggml's `ggml_fp32_to_bf16_row_ref`;
/// subnormals are rounded, not flushed). Non-finite values are an error.
pub fn encode_bf16(x: &[f32]) -> Result<Vec<u16>, QuantError> {
    let mut out = vec![0u16; x.len()];
    encode_bf16_into(x, &mut out)?;
    Ok(out)
}

/// [`encode_bf16`] into a caller buffer (`out.len() == x.len()`).
pub fn encode_bf16_into(x: &[f32], out: &mut [u16]) -> Result<(), QuantError> {
    check_out("bf16 output", x.len(), out.len())?;
    if encode_chunks(x, out, 1, bf16_kernel) {
        Ok(())
    } else {
        Err(first_non_finite(x))
    }
}

/// f32 -> IEEE binary16 bit patterns, round to nearest even (subnormals kept, overflow
/// to ±Inf, as ggml and numpy). Non-finite inputs are an error.
pub fn encode_f16(x: &[f32]) -> Result<Vec<u16>, QuantError> {
    let mut out = vec![0u16; x.len()];
    encode_f16_into(x, &mut out)?;
    Ok(out)
}

/// [`encode_f16`] into a caller buffer (`out.len() == x.len()`).
pub fn encode_f16_into(x: &[f32], out: &mut [u16]) -> Result<(), QuantError> {
    check_out("f16 output", x.len(), out.len())?;
    if encode_chunks(x, out, 1, f16_kernel) {
        Ok(())
    } else {
        Err(first_non_finite(x))
    }
}

/// bf16 bit patterns -> f32 (exact). Lenient form: decodes `min(bits.len(), out.len())`
/// values. See [`try_decode_bf16`].
pub fn decode_bf16(bits: &[u16], out: &mut [f32]) {
    let n = bits.len().min(out.len());
    decode_chunks(&bits[..n], &mut out[..n], 1, dbf16_kernel);
}

/// bf16 bit patterns -> f32 with a length check (`out.len() == bits.len()`).
pub fn try_decode_bf16(bits: &[u16], out: &mut [f32]) -> Result<(), QuantError> {
    check_out("bf16 decode output", bits.len(), out.len())?;
    decode_chunks(bits, out, 1, dbf16_kernel);
    Ok(())
}

/// f16 bit patterns -> f32 (exact). Lenient form: decodes `min(bits.len(), out.len())`
/// values. See [`try_decode_f16`].
pub fn decode_f16(bits: &[u16], out: &mut [f32]) {
    let n = bits.len().min(out.len());
    decode_chunks(&bits[..n], &mut out[..n], 1, df16_kernel);
}

/// f16 bit patterns -> f32 with a length check (`out.len() == bits.len()`).
pub fn try_decode_f16(bits: &[u16], out: &mut [f32]) -> Result<(), QuantError> {
    check_out("f16 decode output", bits.len(), out.len())?;
    decode_chunks(bits, out, 1, df16_kernel);
    Ok(())
}

fn le_u16s(bytes: &[u8]) -> Result<Vec<u16>, QuantError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(QuantError::ByteLength {
            len: bytes.len(),
            elem: 2,
        });
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// Decodes little-endian 16-bit values without a copy when the bytes are 2-aligned on a
/// little-endian host, else through a copy.
fn decode_le16(
    bytes: &[u8],
    f: impl Fn(&[u16], &mut [f32]) -> Result<(), QuantError>,
) -> Result<Vec<f32>, QuantError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(QuantError::ByteLength {
            len: bytes.len(),
            elem: 2,
        });
    }
    let mut out = vec![0.0f32; bytes.len() / 2];
    if cfg!(target_endian = "little") {
        if let Ok(bits) = bytemuck::try_cast_slice::<u8, u16>(bytes) {
            f(bits, &mut out)?;
            return Ok(out);
        }
    }
    f(&le_u16s(bytes)?, &mut out)?;
    Ok(out)
}

/// Decode little-endian bf16 bytes as they sit in a safetensors file.
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Result<Vec<f32>, QuantError> {
    decode_le16(bytes, try_decode_bf16)
}

/// Decode little-endian f16 bytes as they sit in a safetensors file.
pub fn f16_bytes_to_f32(bytes: &[u8]) -> Result<Vec<f32>, QuantError> {
    decode_le16(bytes, try_decode_f16)
}

/// q8_0 blocks from raw GGUF bytes (any alignment; 34 bytes per block).
pub fn q8_0_blocks_from_bytes(bytes: &[u8]) -> Result<Vec<BlockQ8_0>, QuantError> {
    blocks_from_bytes(bytes)
}

/// q4_0 blocks from raw GGUF bytes (any alignment; 18 bytes per block).
pub fn q4_0_blocks_from_bytes(bytes: &[u8]) -> Result<Vec<BlockQ4_0>, QuantError> {
    blocks_from_bytes(bytes)
}

fn blocks_from_bytes<T: Pod>(bytes: &[u8]) -> Result<Vec<T>, QuantError> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) {
        return Err(QuantError::ByteLength {
            len: bytes.len(),
            elem: size,
        });
    }
    Ok(bytes
        .chunks_exact(size)
        .map(bytemuck::pod_read_unaligned)
        .collect())
}

/// The portable kernels, exposed for tests and benchmarks that compare them with the
/// vectorised ones. Not part of the stable API.
#[doc(hidden)]
pub mod portable {
    use super::*;

    /// q8_0 row with the scalar kernel (lengths as [`quantize_row_q8_0`]).
    pub fn quantize_row_q8_0(x: &[f32], out: &mut [BlockQ8_0]) -> Result<(), QuantError> {
        check_len(x, QK)?;
        check_out("q8_0 output blocks", x.len() / QK, out.len())?;
        if scalar::q8_0_row(x, out) {
            Ok(())
        } else {
            Err(first_non_finite(x))
        }
    }

    /// q4_0 row with the scalar kernel (lengths as [`quantize_row_q4_0`]).
    pub fn quantize_row_q4_0(x: &[f32], out: &mut [BlockQ4_0]) -> Result<(), QuantError> {
        check_len(x, QK)?;
        check_out("q4_0 output blocks", x.len() / QK, out.len())?;
        if scalar::q4_0_row(x, out) {
            Ok(())
        } else {
            Err(first_non_finite(x))
        }
    }

    /// Scalar q8_0 decode (lengths as [`dequantize_row_q8_0`]).
    pub fn dequantize_row_q8_0(b: &[BlockQ8_0], out: &mut [f32]) -> Result<(), QuantError> {
        check_out("q8_0 dequantize output", b.len() * QK, out.len())?;
        scalar::dq8_0_row(b, out);
        Ok(())
    }

    /// Scalar q4_0 decode (lengths as [`dequantize_row_q4_0`]).
    pub fn dequantize_row_q4_0(b: &[BlockQ4_0], out: &mut [f32]) -> Result<(), QuantError> {
        check_out("q4_0 dequantize output", b.len() * QK, out.len())?;
        scalar::dq4_0_row(b, out);
        Ok(())
    }

    /// Scalar bf16 encode.
    pub fn encode_bf16(x: &[f32]) -> Result<Vec<u16>, QuantError> {
        let mut out = vec![0u16; x.len()];
        if scalar::bf16_row(x, &mut out) {
            Ok(out)
        } else {
            Err(first_non_finite(x))
        }
    }

    /// Scalar f16 encode.
    pub fn encode_f16(x: &[f32]) -> Result<Vec<u16>, QuantError> {
        let mut out = vec![0u16; x.len()];
        if scalar::f16_row(x, &mut out) {
            Ok(out)
        } else {
            Err(first_non_finite(x))
        }
    }

    /// Scalar bf16 / f16 decode.
    pub fn decode_bf16(bits: &[u16], out: &mut [f32]) {
        scalar::dbf16_row(bits, out)
    }

    /// Scalar f16 decode.
    pub fn decode_f16(bits: &[u16], out: &mut [f32]) {
        scalar::df16_row(bits, out)
    }

    /// Whether the vectorised kernels run on this CPU.
    pub fn simd_active() -> bool {
        simd()
    }
}

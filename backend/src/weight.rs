use dflash_quant::{BlockQ4_0, BlockQ8_0, QK};

use crate::{Backend, BackendError, Result};

/// [`WeightFormat::Q8_0A8`]: 32-value blocks per chunk of the f32 accumulation (each chunk
/// is its own fused multiply-add chain from 0; the chunk results are added in order).
pub const A8_CHUNK_BLOCKS: usize = 32;

/// Storage format of a weight matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    Bf16,
    F16,
    Q8_0,
    Q4_0,
    /// q8_0 storage (ggml blocks, as [`WeightFormat::Q8_0`]) used the way ggml's CPU backend
    /// uses it: `matmul` first quantizes each row of `x` to q8_0 (byte-exact with ggml's
    /// `quantize_row_q8_0`, i.e. `dflash_quant::quantize_q8_0` of the row), then computes
    /// `out[r, o] = Σ_b (d_w[o, b] · d_x[r, b]) · Σ_{i ∈ b} q_w[o, i] · q_x[r, i]`, the
    /// per-block integer sums exact (int32), the f32 scale products and the accumulation over
    /// blocks in block order. The integer dot is what makes it fast (VNNI `vpdpbusd` on the
    /// CPU, int8 tensor cores / dp4a on the GPU); the price is the 8-bit rounding of `x`, the
    /// same as llama.cpp's q8_0 on the CPU. Meant for the drafter, whose numerics only change
    /// what it proposes, never what is committed. `gather_rows` dequantizes exactly as q8_0.
    ///
    /// The f32 part exactly (every backend gives these bits), with `nb = cols / 32` and the
    /// blocks taken in chunks of [`A8_CHUNK_BLOCKS`] (= 32 blocks, 1024 values; the last chunk
    /// may be shorter):
    /// ```text
    /// for c in 0 .. ceil(nb / 32):
    ///     acc_c = 0.0f32
    ///     for b in 32c .. min(32c + 32, nb):
    ///         isum  = Σ_{i<32} q_w[o, 32b+i] · q_x[r, 32b+i]      (exact int32)
    ///         s     = f32(d_w[o, b]) * f32(d_x[r, b])             (f16 scales widened; f32 product)
    ///         acc_c = fma(f32(isum), s, acc_c)                    (one rounding)
    /// out[r, o] = acc_0
    /// for c in 1 .. ceil(nb / 32):  out[r, o] = out[r, o] + acc_c    (plain f32 adds, chunk order)
    /// ```
    /// (`cols = 0` gives 0.) For `cols <= 1024` this is one chain over the blocks in order.
    /// The chunks let a GPU split K over thread blocks (one chunk each) and still give these
    /// bits: the per-chunk chains and the ordered sum do not depend on the launch shape.
    /// `f32(isum)` is exact (`|isum| <= 32·128·127 < 2^24`) and so is `s` (two f16 values:
    /// at most 22 significant bits, no overflow or underflow in f32), so the only roundings
    /// are the fused multiply-adds (on the GPU: `fmaf`, not `a * b + c` contracted or not at
    /// the compiler's whim) and the `ceil(nb / 32) - 1` chunk adds. A row of `x` holding a NaN
    /// or an infinity cannot be quantized: `matmul` returns an error naming the weight and the
    /// row. A row's result depends only on that row (per-row determinism, as every matmul).
    Q8_0A8,
    /// q4_0 storage (ggml blocks, as [`WeightFormat::Q4_0`]) used the way ggml's CPU backend
    /// uses it (`vec_dot_q4_0_q8_0`): exactly [`WeightFormat::Q8_0A8`]'s contract over the
    /// q8_0 blocks of the same values ([`dflash_quant::widen_q4_0`]: codes `code - 8` in
    /// -8..=7, the same scale), so the same bits as a `Q8_0A8` matmul of the widened weight,
    /// from half its bytes (18 per 32 values instead of 34). For a drafter whose matrices
    /// stream at the memory's rate: twice the weights per byte on the int8 tensor cores.
    Q4_0A8,
}

impl WeightFormat {
    /// Formats stored in 32-value blocks (rows must hold whole blocks).
    pub fn is_block(self) -> bool {
        matches!(
            self,
            WeightFormat::Q8_0 | WeightFormat::Q4_0 | WeightFormat::Q8_0A8 | WeightFormat::Q4_0A8
        )
    }

    /// The formats whose `matmul` quantizes `x` to q8_0 and takes exact integer block dots
    /// ([`WeightFormat::Q8_0A8`]'s contract): `Q8_0A8` and `Q4_0A8`.
    pub fn is_a8(self) -> bool {
        matches!(self, WeightFormat::Q8_0A8 | WeightFormat::Q4_0A8)
    }

    /// Bytes used by `n` values (n a multiple of 32 for the block formats).
    pub fn bytes_for(self, n: usize) -> usize {
        match self {
            WeightFormat::F32 => 4 * n,
            WeightFormat::Bf16 | WeightFormat::F16 => 2 * n,
            WeightFormat::Q8_0 | WeightFormat::Q8_0A8 => n / QK * std::mem::size_of::<BlockQ8_0>(),
            WeightFormat::Q4_0 | WeightFormat::Q4_0A8 => n / QK * std::mem::size_of::<BlockQ4_0>(),
        }
    }
}

/// Host values of a weight in one storage format (row-major `[rows, cols]`; block formats
/// quantize each row independently, so `cols` must be a multiple of 32 for them).
#[derive(Clone, Debug)]
pub enum HostData {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE binary16 bit patterns.
    F16(Vec<u16>),
    Q8_0(Vec<BlockQ8_0>),
    Q4_0(Vec<BlockQ4_0>),
    /// q8_0 blocks for [`WeightFormat::Q8_0A8`] (activations quantized at matmul time).
    Q8_0A8(Vec<BlockQ8_0>),
    /// q4_0 blocks for [`WeightFormat::Q4_0A8`] (activations quantized at matmul time).
    Q4_0A8(Vec<BlockQ4_0>),
}

impl HostData {
    pub fn format(&self) -> WeightFormat {
        match self {
            HostData::F32(_) => WeightFormat::F32,
            HostData::Bf16(_) => WeightFormat::Bf16,
            HostData::F16(_) => WeightFormat::F16,
            HostData::Q8_0(_) => WeightFormat::Q8_0,
            HostData::Q8_0A8(_) => WeightFormat::Q8_0A8,
            HostData::Q4_0(_) => WeightFormat::Q4_0,
            HostData::Q4_0A8(_) => WeightFormat::Q4_0A8,
        }
    }

    /// Number of values represented.
    pub fn n_values(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::Bf16(v) | HostData::F16(v) => v.len(),
            HostData::Q8_0(b) | HostData::Q8_0A8(b) => b.len() * QK,
            HostData::Q4_0(b) | HostData::Q4_0A8(b) => b.len() * QK,
        }
    }

    /// Raw little-endian bytes of the storage.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostData::F32(v) => bytemuck::cast_slice(v),
            HostData::Bf16(v) | HostData::F16(v) => bytemuck::cast_slice(v),
            HostData::Q8_0(b) | HostData::Q8_0A8(b) => bytemuck::cast_slice(b),
            HostData::Q4_0(b) | HostData::Q4_0A8(b) => bytemuck::cast_slice(b),
        }
    }
}

/// A named weight matrix on the host, ready to upload.
#[derive(Clone, Debug)]
pub struct HostWeight {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub data: HostData,
}

impl HostWeight {
    /// Build and check that the data holds `rows * cols` values (and that block formats have
    /// whole blocks per row).
    pub fn new(name: impl Into<String>, rows: usize, cols: usize, data: HostData) -> Result<Self> {
        let name = name.into();
        let fmt = data.format();
        if fmt.is_block() && !cols.is_multiple_of(QK) {
            return Err(BackendError::Weight(format!(
                "{name}: {fmt:?} needs rows whose length is a multiple of {QK}, found {cols}"
            )));
        }
        if data.n_values() != rows * cols {
            return Err(BackendError::Weight(format!(
                "{name}: expected {rows}x{cols} = {} values, found {}",
                rows * cols,
                data.n_values()
            )));
        }
        Ok(HostWeight {
            name,
            rows,
            cols,
            data,
        })
    }

    /// Re-encode an f32 matrix into `format` (byte-exact with ggml for the block formats).
    pub fn from_f32(
        name: impl Into<String>,
        rows: usize,
        cols: usize,
        values: &[f32],
        format: WeightFormat,
    ) -> Result<Self> {
        let data = match format {
            WeightFormat::F32 => HostData::F32(values.to_vec()),
            WeightFormat::Bf16 => HostData::Bf16(dflash_quant::encode_bf16(values)?),
            WeightFormat::F16 => HostData::F16(dflash_quant::encode_f16(values)?),
            WeightFormat::Q8_0 => HostData::Q8_0(dflash_quant::quantize_q8_0(values)?),
            WeightFormat::Q8_0A8 => HostData::Q8_0A8(dflash_quant::quantize_q8_0(values)?),
            WeightFormat::Q4_0 => HostData::Q4_0(dflash_quant::quantize_q4_0(values)?),
            WeightFormat::Q4_0A8 => HostData::Q4_0A8(dflash_quant::quantize_q4_0(values)?),
        };
        HostWeight::new(name, rows, cols, data)
    }

    /// Decode to f32 (exact for every format: it is what the format defines).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        match &self.data {
            HostData::F32(v) => out.copy_from_slice(v),
            HostData::Bf16(v) => dflash_quant::decode_bf16(v, &mut out),
            HostData::F16(v) => dflash_quant::decode_f16(v, &mut out),
            HostData::Q8_0(b) | HostData::Q8_0A8(b) => dflash_quant::dequantize_q8_0(b, &mut out),
            HostData::Q4_0(b) | HostData::Q4_0A8(b) => dflash_quant::dequantize_q4_0(b, &mut out),
        }
        out
    }
}

/// A weight matrix resident on a backend: `[rows, cols]` = `[out_features, in_features]`.
pub struct Weight<B: Backend> {
    pub name: String,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    pub buf: B::WeightBuf,
}

impl<B: Backend> std::fmt::Debug for Weight<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Weight({} {:?} [{}, {}])",
            self.name, self.format, self.rows, self.cols
        )
    }
}

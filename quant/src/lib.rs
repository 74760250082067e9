//! ggml-exact host codecs (FIRST CUT: scalar, API frozen for the other crates; the quant
//! issue replaces the internals with the optimised, fully tested version).

use bytemuck::{Pod, Zeroable};
use half::{bf16, f16};
use rayon::prelude::*;
use thiserror::Error;

/// Values per block for q8_0 and q4_0.
pub const QK: usize = 32;

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);

#[derive(Debug, Error, Clone, PartialEq)]
pub enum QuantError {
    #[error("non-finite value {value} at element {index}")]
    NonFinite { index: usize, value: f32 },
    #[error("row length {len} is not a multiple of {block}")]
    Length { len: usize, block: usize },
    #[error("byte length {len} is not a multiple of {elem} bytes")]
    ByteLength { len: usize, elem: usize },
}

fn check(x: &[f32], block: usize) -> Result<(), QuantError> {
    if x.len() % block != 0 {
        return Err(QuantError::Length { len: x.len(), block });
    }
    if let Some((index, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::NonFinite { index, value });
    }
    Ok(())
}

/// C's float -> int conversion as x86 does it (cvttss2si: out of range / NaN -> i32::MIN).
fn c_f32_to_i32(v: f32) -> i32 {
    if v.is_nan() || v >= 2147483648.0 || v < -2147483648.0 {
        i32::MIN
    } else {
        v as i32
    }
}

fn q8_block(x: &[f32]) -> BlockQ8_0 {
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = c_f32_to_i32((v * id).round()) as i8;
    }
    BlockQ8_0 { d: f16::from_f32(d), qs }
}

fn q4_block(x: &[f32]) -> BlockQ4_0 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0u8; QK / 2];
    for j in 0..QK / 2 {
        let x0 = x[j] * id;
        let x1 = x[j + QK / 2] * id;
        let c0 = (c_f32_to_i32(x0 + 8.5) as i8).min(15) as u8;
        let c1 = (c_f32_to_i32(x1 + 8.5) as i8).min(15) as u8;
        qs[j] = c0 | (c1 << 4);
    }
    BlockQ4_0 { d: f16::from_f32(d), qs }
}

pub fn quantize_q8_0(x: &[f32]) -> Result<Vec<BlockQ8_0>, QuantError> {
    check(x, QK)?;
    Ok(x.par_chunks(QK).map(q8_block).collect())
}

pub fn quantize_q4_0(x: &[f32]) -> Result<Vec<BlockQ4_0>, QuantError> {
    check(x, QK)?;
    Ok(x.par_chunks(QK).map(q4_block).collect())
}

pub fn dequantize_q8_0(b: &[BlockQ8_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK)) {
        let d = blk.d.to_f32();
        for (y, &q) in o.iter_mut().zip(&blk.qs) {
            *y = q as f32 * d;
        }
    }
}

pub fn dequantize_q4_0(b: &[BlockQ4_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK)) {
        let d = blk.d.to_f32();
        for j in 0..QK / 2 {
            o[j] = ((blk.qs[j] & 0x0F) as i32 - 8) as f32 * d;
            o[j + QK / 2] = ((blk.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub fn encode_bf16(x: &[f32]) -> Result<Vec<u16>, QuantError> {
    check(x, 1)?;
    Ok(x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect())
}

pub fn encode_f16(x: &[f32]) -> Result<Vec<u16>, QuantError> {
    check(x, 1)?;
    Ok(x.iter().map(|&v| f16::from_f32(v).to_bits()).collect())
}

pub fn decode_bf16(bits: &[u16], out: &mut [f32]) {
    for (y, &b) in out.iter_mut().zip(bits) {
        *y = f32::from_bits((b as u32) << 16);
    }
}

pub fn decode_f16(bits: &[u16], out: &mut [f32]) {
    for (y, &b) in out.iter_mut().zip(bits) {
        *y = f16::from_bits(b).to_f32();
    }
}

/// Decode little-endian bf16 bytes as they sit in a safetensors file.
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Result<Vec<f32>, QuantError> {
    if bytes.len() % 2 != 0 {
        return Err(QuantError::ByteLength { len: bytes.len(), elem: 2 });
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect())
}

/// Decode little-endian f16 bytes as they sit in a safetensors file.
pub fn f16_bytes_to_f32(bytes: &[u8]) -> Result<Vec<f32>, QuantError> {
    if bytes.len() % 2 != 0 {
        return Err(QuantError::ByteLength { len: bytes.len(), elem: 2 });
    }
    Ok(bytes
        .chunks_exact(2)
        .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect())
}

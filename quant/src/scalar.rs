//! Portable kernels: the ggml reference arithmetic written out per block.
//!
//! These are exact for every finite input (they are also the fallback on machines without
//! AVX2/F16C). Each row kernel returns `false` when it met a non-finite value; the caller
//! then reports the first such element and discards the output.

use half::{bf16, f16};

use crate::{BlockQ4_0, BlockQ8_0, QK};

/// C's float -> int conversion as x86-64 compilers emit it (`cvttss2si`): truncation toward
/// zero, and the "integer indefinite" value `i32::MIN` for NaN and out-of-range inputs.
#[inline]
pub(crate) fn c_f32_to_i32(v: f32) -> i32 {
    if v.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        i32::MIN
    } else {
        v as i32
    }
}

/// One q8_0 block (`x.len() == QK`, all finite).
#[inline]
pub(crate) fn q8_0_block(x: &[f32]) -> BlockQ8_0 {
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        // C `MAX(amax, a)`.
        amax = if amax > a { amax } else { a };
    }
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        // f32::round is roundf: half away from zero. The int8 store truncates the int.
        *q = c_f32_to_i32((v * id).round()) as i8;
    }
    BlockQ8_0 {
        d: f16::from_f32(d),
        qs,
    }
}

/// One q4_0 block (`x.len() == QK`, all finite).
#[inline]
pub(crate) fn q4_0_block(x: &[f32]) -> BlockQ4_0 {
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
    for (j, q) in qs.iter_mut().enumerate() {
        let x0 = x[j] * id;
        let x1 = x[j + QK / 2] * id;
        // `+ 8.5` is its own f32 add (never fused), then C's truncating conversion to int8.
        let c0 = (c_f32_to_i32(x0 + 8.5) as i8).min(15) as u8;
        let c1 = (c_f32_to_i32(x1 + 8.5) as i8).min(15) as u8;
        *q = c0 | (c1 << 4);
    }
    BlockQ4_0 {
        d: f16::from_f32(d),
        qs,
    }
}

fn all_finite(x: &[f32]) -> bool {
    x.iter().all(|v| v.is_finite())
}

pub(crate) fn q8_0_row(x: &[f32], out: &mut [BlockQ8_0]) -> bool {
    if !all_finite(x) {
        return false;
    }
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        *o = q8_0_block(xb);
    }
    true
}

pub(crate) fn q4_0_row(x: &[f32], out: &mut [BlockQ4_0]) -> bool {
    if !all_finite(x) {
        return false;
    }
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        *o = q4_0_block(xb);
    }
    true
}

pub(crate) fn dq8_0_row(b: &[BlockQ8_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK)) {
        let d = blk.d.to_f32();
        for (y, &q) in o.iter_mut().zip(&blk.qs) {
            *y = q as f32 * d;
        }
    }
}

pub(crate) fn dq4_0_row(b: &[BlockQ4_0], out: &mut [f32]) {
    for (blk, o) in b.iter().zip(out.chunks_exact_mut(QK)) {
        let d = blk.d.to_f32();
        let (lo, hi) = o.split_at_mut(QK / 2);
        for ((&q, y0), y1) in blk.qs.iter().zip(lo).zip(hi) {
            *y0 = ((q & 0x0F) as i32 - 8) as f32 * d;
            *y1 = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub(crate) fn bf16_row(x: &[f32], out: &mut [u16]) -> bool {
    if !all_finite(x) {
        return false;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16::from_f32(v).to_bits();
    }
    true
}

pub(crate) fn f16_row(x: &[f32], out: &mut [u16]) -> bool {
    if !all_finite(x) {
        return false;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f16::from_f32(v).to_bits();
    }
    true
}

pub(crate) fn dbf16_row(bits: &[u16], out: &mut [f32]) {
    for (y, &b) in out.iter_mut().zip(bits) {
        *y = f32::from_bits((b as u32) << 16);
    }
}

pub(crate) fn df16_row(bits: &[u16], out: &mut [f32]) {
    for (y, &b) in out.iter_mut().zip(bits) {
        *y = f16::from_bits(b).to_f32();
    }
}

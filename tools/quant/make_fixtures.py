#!/usr/bin/env python3
"""Golden vectors for dflash-quant, made by the PyPI package gguf==0.19.0.

Usage: python tools/quant/make_fixtures.py [OUT_DIR]   (default quant/tests/fixtures)

Writes, for one adversarial input set (little-endian, raw):
  inputs.f32        the f32 inputs, whole blocks of 32 values
  q8_0.bin          gguf.quants.quantize(x, Q8_0)   34 bytes per block
  q4_0.bin          gguf.quants.quantize(x, Q4_0)   18 bytes per block (see the -0.0 note)
  bf16.bin          gguf.quants.quantize(x, BF16)   2 bytes per value
  f16.bin           gguf.quants.quantize(x, F16)    2 bytes per value (numpy astype, RNE)
  q8_0.deq.f32      gguf.quants.dequantize(q8_0.bin, Q8_0)
  q4_0.deq.f32      gguf.quants.dequantize(q4_0.bin, Q4_0)
  manifest.txt      versions, seed, one line per category, the patched blocks

The -0.0 note (quant-exactness.md §7, §10): for an all-zero q4_0 block ggml's C reference
never updates its running signed max, which stays +0.0, so d = +0.0 / -8 = -0.0 (f16 0x8000).
gguf-py takes the element at argmax(|x|) = index 0, so when x[0] is -0.0 it writes
d = -0.0 / -8 = +0.0 (0x0000). These blocks are the only finite inputs where gguf 0.19.0
and the C reference differ; this script checks that gguf wrote 0x0000 there, replaces it with
the C bytes 0x8000, and lists the block indices in the manifest (`patched_q4_0_blocks`).
The Rust test checks that every listed block is such a block.
"""
import sys
import os

import numpy as np
from gguf.quants import quantize, dequantize
from gguf.constants import GGMLQuantizationType as T

SEED = 20261129
QK = 32


def bf16_round(x):
    """Round f32 to the nearest bf16 (RNE), back to f32 (the bf16-origin weights of HF files)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def categories(rng):
    cats = []

    def add(name, blocks):
        b = f32(blocks).reshape(-1, QK)
        assert np.all(np.isfinite(b)), name
        cats.append((name, b))

    # 1. raw f32 gaussians, typical weight scale
    add("gauss_f32", rng.normal(0, 0.02, (192, QK)))
    # 2. bf16-origin weights (the data where ties show up)
    add("bf16_origin", bf16_round(rng.normal(0, 0.02, (384, QK))))
    # 3. f16-origin weights
    add("f16_origin", rng.normal(0, 0.05, (96, QK)).astype(np.float16).astype(np.float32))
    # 4. half-integer multiples of a per-block scale (bf16-rounded scales)
    s = bf16_round(10.0 ** rng.uniform(-4, 1, (192, 1)))
    k = rng.integers(-254, 255, (192, QK))
    add("half_int_multiples", k.astype(np.float32) * np.float32(0.5) * s)
    # 5. exact q8_0 ties: amax = 127 * 2^e so d = 2^e, id = 2^-e, t = n + 0.5 exactly
    b = np.empty((128, QK), np.float32)
    for i in range(128):
        e = rng.integers(-20, 10)
        sc = np.float32(2.0) ** e
        n = rng.integers(-127, 127, QK).astype(np.float32) + np.float32(0.5)
        n = np.clip(n, -126.5, 126.5)
        row = n * sc
        row[rng.integers(0, QK)] = np.float32(127.0) * sc * (1 if rng.random() < 0.5 else -1)
        b[i] = row
    add("q8_ties", b)
    # 6. exact q4_0 ties: max = +-8 * 2^e so |d| = 2^e, t + 8.5 lands on integers
    b = np.empty((128, QK), np.float32)
    for i in range(128):
        e = rng.integers(-20, 10)
        sc = np.float32(2.0) ** e
        n = rng.integers(-8, 8, QK).astype(np.float32) + np.float32(0.5)
        row = n * sc
        row[rng.integers(0, QK)] = np.float32(8.0) * sc * (1 if rng.random() < 0.5 else -1)
        b[i] = row
    add("q4_ties", b)
    # 7. q4_0 signed max ties: +a and -a both present, in random order
    b = rng.normal(0, 1, (64, QK)).astype(np.float32)
    for i in range(64):
        a = np.float32(abs(b[i]).max() * 1.5)
        p, q = rng.choice(QK, 2, replace=False)
        b[i, p], b[i, q] = a, -a
    add("q4_sign_ties", b)
    # 8. zero blocks: +0, -0 and mixtures (the q4_0 -0.0 trap)
    z = np.zeros((12, QK), np.float32)
    z[1] = -0.0
    z[2, 0] = -0.0
    z[3, 1:] = -0.0
    z[4, ::2] = -0.0
    z[5, 1::2] = -0.0
    z[6, 31] = -0.0
    z[7] = np.where(rng.random(QK) < 0.5, np.float32(-0.0), np.float32(0.0))
    z[8, 0] = -0.0
    z[8, 5] = np.float32(1e-3)
    z[9, 0] = -0.0
    z[9, 17] = np.float32(-2.5)
    z[10, 3] = np.float32(7.0)
    z[11] = -0.0
    z[11, 0] = 0.0
    add("zero_blocks", z)
    # 9. tiny blocks: f32 subnormals and scales whose reciprocal overflows (d < 2^-128)
    b = np.empty((64, QK), np.float32)
    for i in range(64):
        if i < 24:
            # all-subnormal f32 inputs
            bits = rng.integers(0, 0x007FFFFF, QK, dtype=np.uint32)
            bits |= (rng.random(QK) < 0.5).astype(np.uint32) << 31
            b[i] = bits.view(np.float32)
        else:
            # amax around the 1/d overflow threshold (127 * 2^-128 ~ 3.7e-37) and around
            # 2^-126 (normal/subnormal boundary of d)
            amax = np.float32(10.0 ** rng.uniform(-40, -34))
            b[i] = f32(rng.uniform(-1, 1, QK)) * amax
    add("tiny", b)
    # 10. f16-subnormal and f16-zero scales: d < 2^-14, d <= 2^-25
    amax = 10.0 ** rng.uniform(-9, -2, (96, 1))
    add("f16_subnormal_scale", bf16_round(rng.uniform(-1, 1, (96, QK)) * amax))
    # 11. huge blocks: d above the f16 range (q8_0 amax >= 8321040, q4_0 |max| >= 524160)
    amax = 10.0 ** rng.uniform(5, 38.5, (64, 1))
    b = f32(np.clip(rng.uniform(-1, 1, (64, QK)) * amax, -3.4e38, 3.4e38))
    b[0, 3] = np.float32(3.4028235e38)
    b[1, 7] = np.float32(-3.4028235e38)
    b[2, :] = np.float32(8321040.0)
    b[3, :] = np.float32(8321039.0)
    b[4, 0] = np.float32(-524160.0)
    b[5, 0] = np.float32(524159.9)
    add("huge", b)
    # 12. the 0.49999997 trap: t = x * id exactly 0.49999997 (and k + that) with d = 1
    b = np.zeros((32, QK), np.float32)
    h = np.float32(0.49999997)
    for i in range(32):
        sgn = np.where(rng.random(QK) < 0.5, np.float32(-1), np.float32(1))
        kk = rng.integers(0, 4, QK).astype(np.float32)
        b[i] = sgn * (kk + h) if i % 2 else sgn * np.full(QK, h, np.float32)
        b[i, rng.integers(0, QK)] = np.float32(127.0) if i % 4 < 2 else np.float32(-8.0)
    add("round_half_trap", b)
    # 13. wide log-uniform scales
    sc = 10.0 ** rng.uniform(-37, 37, (192, 1))
    add("wide_scales", f32(np.clip(rng.normal(0, 1, (192, QK)) * sc, -3e38, 3e38)))
    # 14. bf16-origin with repeated values and small integers (ties galore)
    add("small_ints", f32(rng.integers(-20, 21, (64, QK))) * np.float32(0.25))
    return cats


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "quant/tests/fixtures"
    from importlib.metadata import version

    gv = version("gguf")
    if gv != "0.19.0":
        sys.exit(f"gguf {gv} installed; the fixtures are defined by gguf==0.19.0")
    rng = np.random.default_rng(SEED)
    cats = categories(rng)
    x = np.concatenate([b for _, b in cats], axis=0).astype(np.float32)
    n_blocks = x.shape[0]
    flat = x.reshape(-1)

    with np.errstate(all="ignore"):
        q8 = quantize(flat, T.Q8_0).reshape(n_blocks, 34).copy()
        q4 = quantize(flat, T.Q4_0).reshape(n_blocks, 18).copy()
        bf = quantize(flat, T.BF16)
        h16 = quantize(flat, T.F16)

    # the documented gguf-py divergence: all-zero q4_0 blocks whose x[0] is -0.0
    patched = []
    for i in range(n_blocks):
        if np.all(x[i] == 0):
            d = q4[i, 0] | (q4[i, 1].astype(np.uint16) << 8)
            if np.signbit(x[i, 0]):
                assert d == 0x0000, (i, hex(d))
                q4[i, 0], q4[i, 1] = 0x00, 0x80
                patched.append(i)
            else:
                assert d == 0x8000, (i, hex(d))

    with np.errstate(all="ignore"):
        dq8 = dequantize(q8.reshape(-1), T.Q8_0).astype(np.float32)
        dq4 = dequantize(q4.reshape(-1), T.Q4_0).astype(np.float32)

    os.makedirs(out_dir, exist_ok=True)

    def w(name, arr):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(np.ascontiguousarray(arr).tobytes())

    w("inputs.f32", flat.astype("<f4"))
    w("q8_0.bin", q8)
    w("q4_0.bin", q4)
    w("bf16.bin", bf.view(np.uint8))
    w("f16.bin", h16.astype("<f2"))
    w("q8_0.deq.f32", dq8.astype("<f4"))
    w("q4_0.deq.f32", dq4.astype("<f4"))
    with open(os.path.join(out_dir, "manifest.txt"), "w") as f:
        f.write("# made by tools/quant/make_fixtures.py; do not edit\n")
        f.write(f"gguf {gv}\nnumpy {np.__version__}\nseed {SEED}\nblocks {n_blocks}\n")
        f.write("patched_q4_0_blocks " + ",".join(map(str, patched)) + "\n")
        start = 0
        for name, b in cats:
            f.write(f"category {name} {start} {b.shape[0]}\n")
            start += b.shape[0]
    print(f"wrote {n_blocks} blocks to {out_dir}; patched q4_0 blocks: {patched}")


if __name__ == "__main__":
    main()

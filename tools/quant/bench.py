#!/usr/bin/env python3
"""gguf==0.19.0 speed on a raw little-endian f32 file, for `cargo xtask bench quant`.

Usage: bench.py INPUT.f32 [MIN_SECONDS]

For each of q8_0, q4_0, bf16, f16: times gguf.quants.quantize and gguf.quants.dequantize on
the whole array (single thread, numpy), repeating until MIN_SECONDS have passed (at least
twice), and prints one JSON object: {format: {"encode_s": median, "decode_s": median}, ...}.
"""
import json
import sys
import time
from importlib.metadata import version

import numpy as np
from gguf.quants import quantize, dequantize
from gguf.constants import GGMLQuantizationType as T


def timeit(f, min_s):
    ts = []
    start = time.perf_counter()
    while len(ts) < 2 or time.perf_counter() - start < min_s:
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), len(ts)


def main():
    x = np.fromfile(sys.argv[1], dtype="<f4")
    min_s = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    out = {"gguf": version("gguf"), "numpy": np.__version__, "values": int(x.size)}
    for name, t in (("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("bf16", T.BF16), ("f16", T.F16)):
        with np.errstate(all="ignore"):
            q = quantize(x, t)
            enc, n_enc = timeit(lambda: quantize(x, t), min_s)
            dec, n_dec = timeit(lambda: dequantize(q.reshape(-1).view(np.uint8), t), min_s)
        out[name] = {"encode_s": enc, "decode_s": dec, "runs": [n_enc, n_dec]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

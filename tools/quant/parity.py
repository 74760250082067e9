#!/usr/bin/env python3
"""Quantize a raw little-endian f32 file with gguf==0.19.0, for `cargo xtask parity quant`.

Usage: parity.py INPUT.f32 OUT_PREFIX

Writes OUT_PREFIX.q8_0, OUT_PREFIX.q4_0, OUT_PREFIX.bf16 and OUT_PREFIX.f16 with the bytes of
gguf.quants.quantize(x, T) for each type, processing the input in chunks (each block is
independent, so chunking does not change the bytes). Prints one JSON line with the gguf and
numpy versions and the number of values. The bytes are gguf's own, unpatched: the caller
handles the documented -0.0 all-zero q4_0 divergence (see make_fixtures.py).
"""
import json
import sys
from importlib.metadata import version

import numpy as np
from gguf.quants import quantize
from gguf.constants import GGMLQuantizationType as T

CHUNK = 1 << 21  # values per chunk (8 MiB of f32)


def main():
    src, prefix = sys.argv[1], sys.argv[2]
    x = np.fromfile(src, dtype="<f4")
    if x.size % 32:
        sys.exit(f"{src}: {x.size} values is not a multiple of 32")
    outs = {name: open(f"{prefix}.{name}", "wb") for name in ("q8_0", "q4_0", "bf16", "f16")}
    types = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "bf16": T.BF16, "f16": T.F16}
    with np.errstate(all="ignore"):
        for s in range(0, x.size, CHUNK):
            c = x[s : s + CHUNK]
            for name, t in types.items():
                outs[name].write(np.ascontiguousarray(quantize(c, t)).tobytes())
    for f in outs.values():
        f.close()
    print(json.dumps({"gguf": version("gguf"), "numpy": np.__version__, "values": int(x.size)}))


if __name__ == "__main__":
    main()

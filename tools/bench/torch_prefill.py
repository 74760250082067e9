#!/usr/bin/env python3
"""PyTorch bf16 prefill of a dense Qwen3 target, the peer of `xtask bench gpu --prefill`.

One forward of P prompt tokens from position 0: embedding -> L Qwen3 layers (RMSNorm, q/k/v
projections, per-head q/k RMSNorm, NeoX RoPE, causal attention through
F.scaled_dot_product_attention with GQA (flash / cuDNN kernels as PyTorch picks them), o
projection, SwiGLU MLP) -> final norm -> lm_head of the last row -> argmax, also writing the
K / V of every layer into a bf16 cache (what a serving engine's prefill keeps). Random bf16
weights, bf16 activations, eager (a prefill is a few hundred long kernels). Prints one JSON
list on stdout: [{"p": P, "ms": median}, ...].

usage: torch_prefill.py --hidden 4096 --layers 36 --heads 32 --kv-heads 8 --head-dim 128 \
    --inter 12288 --vocab 151936 --p 512,2048,8192 --iters 5
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from torch_drafter import rms, rope  # the drafter peer's RMSNorm and NeoX RoPE (same folder)


class Target:
    def __init__(self, a, cap, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        dt = torch.bfloat16
        H, hd, nh, nkv, I, V = a.hidden, a.head_dim, a.heads, a.kv_heads, a.inter, a.vocab

        def w(o, i):
            return (torch.rand(o, i, generator=g, device=dev, dtype=dt) * 2 - 1) * (1.0 / math.sqrt(i))

        self.a = a
        self.embed = w(V, H)
        self.lm_head = w(V, H)
        self.norm = torch.ones(H, device=dev, dtype=dt)
        self.layers = []
        for _ in range(a.layers):
            self.layers.append(dict(
                ln1=torch.ones(H, device=dev, dtype=dt), ln2=torch.ones(H, device=dev, dtype=dt),
                wqkv=w((nh + 2 * nkv) * hd, H), wo=w(H, nh * hd),
                qn=torch.ones(hd, device=dev, dtype=dt), kn=torch.ones(hd, device=dev, dtype=dt),
                wgu=w(2 * I, H), wd=w(H, I),
                kc=torch.empty(1, nkv, cap, hd, device=dev, dtype=dt),
                vc=torch.empty(1, nkv, cap, hd, device=dev, dtype=dt)))
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        pos = torch.arange(0, cap, device=dev, dtype=torch.float32)
        ang = pos[:, None] * inv[None, :]
        self.cos = ang.cos().to(dt)[None, None]
        self.sin = ang.sin().to(dt)[None, None]
        self.ids = torch.randint(0, V, (cap,), generator=g, device=dev)

    @torch.inference_mode()
    def prefill(self, p):
        a = self.a
        H, hd, nh, nkv, I = a.hidden, a.head_dim, a.heads, a.kv_heads, a.inter
        cos, sin = self.cos[:, :, :p], self.sin[:, :, :p]
        h = F.embedding(self.ids[:p], self.embed)
        for L in self.layers:
            x = rms(h, L["ln1"])
            qkv = x @ L["wqkv"].t()
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = rms(q.view(p, nh, hd), L["qn"]).transpose(0, 1)[None]
            k = rms(k.view(p, nkv, hd), L["kn"]).transpose(0, 1)[None]
            v = v.view(p, nkv, hd).transpose(0, 1)[None]
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            L["kc"][:, :, :p] = k
            L["vc"][:, :, :p] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + o[0].transpose(0, 1).reshape(p, nh * hd) @ L["wo"].t()
            x = rms(h, L["ln2"])
            gu = x @ L["wgu"].t()
            gt, up = gu.split([I, I], dim=-1)
            h = h + (F.silu(gt) * up) @ L["wd"].t()
        last = rms(h[-1:], self.norm)
        return (last @ self.lm_head.t()).argmax(-1)


def main():
    ap = argparse.ArgumentParser()
    for k in ("hidden", "layers", "heads", "kv-heads", "head-dim", "inter", "vocab", "iters"):
        ap.add_argument("--" + k, type=int, required=k != "iters", default=5)
    ap.add_argument("--p", required=True)
    a = ap.parse_args()
    ps = [int(x) for x in a.p.split(",")]
    dev = torch.device("cuda")
    t = Target(a, max(ps), dev)
    out = []
    for p in ps:
        for _ in range(2):
            t.prefill(p)
        times = []
        for _ in range(a.iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t.prefill(p)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        times.sort()
        ms = times[len(times) // 2]
        print(f"torch bf16 prefill P {p}: {ms:.2f} ms ({p / ms * 1e3:.0f} tok/s)", flush=True)
        out.append({"p": p, "ms": ms})
    del t
    torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

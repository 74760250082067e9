#!/usr/bin/env python3
"""PyTorch bf16 reference of the DFlash draft step, timed eager and as a CUDA graph.

The same structure as `cargo xtask bench gpu` runs on our backend: block of b tokens ->
embedding -> L Qwen3-style layers (RMSNorm, q/k/v projections, per-head q/k RMSNorm, NeoX
RoPE, attention of the block over [cached ctx K/V ; block K/V] with GQA, non-causal, an
optional sliding window over absolute positions, o projection, SwiGLU MLP) -> final norm ->
lm_head on rows 1..b-1 -> argmax. Random bf16 weights, bf16 activations and KV cache
(what a PyTorch user would run). Prints one JSON object per (shape, ctx) on stdout.

usage: torch_drafter.py --hidden 4096 --layers 5 --heads 32 --kv-heads 8 --head-dim 128 \
    --inter 12288 --vocab 151936 --block 16 --windows none,none,... --ctx 512,8192
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F


def rms(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x, cos, sin):
    # x [b, h, T, d]; neox rotate-half
    d2 = x.shape[-1] // 2
    x1, x2 = x[..., :d2], x[..., d2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Drafter:
    def __init__(self, a, ctx, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        dt = torch.bfloat16
        H, hd, nh, nkv, I, V = a.hidden, a.head_dim, a.heads, a.kv_heads, a.inter, a.vocab

        def w(o, i):
            return (torch.rand(o, i, generator=g, device=dev, dtype=dt) * 2 - 1) * (1.0 / math.sqrt(i))

        self.a = a
        self.ctx = ctx
        self.embed = w(V, H)
        self.lm_head = w(V, H)
        self.norm = torch.ones(H, device=dev, dtype=dt)
        self.layers = []
        cap = ctx + a.block
        for li in range(a.layers):
            self.layers.append(dict(
                ln1=torch.ones(H, device=dev, dtype=dt), ln2=torch.ones(H, device=dev, dtype=dt),
                wq=w(nh * hd, H), wk=w(nkv * hd, H), wv=w(nkv * hd, H), wo=w(H, nh * hd),
                qn=torch.ones(hd, device=dev, dtype=dt), kn=torch.ones(hd, device=dev, dtype=dt),
                wg=w(I, H), wu=w(I, H), wd=w(H, I),
                kc=torch.randn(1, nkv, cap, hd, generator=g, device=dev, dtype=dt),
                vc=torch.randn(1, nkv, cap, hd, generator=g, device=dev, dtype=dt),
                window=a.windows[li]))
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
        pos = torch.arange(ctx, ctx + a.block, device=dev, dtype=torch.float32)
        ang = pos[:, None] * inv[None, :]
        self.cos = ang.cos().to(dt)[None, None]
        self.sin = ang.sin().to(dt)[None, None]
        # masks (None = attend to everything: non-causal full layer)
        self.masks = {}
        kpos = torch.arange(0, cap, device=dev)
        qpos = pos.long()
        for wdw in set(a.windows):
            if wdw is None:
                self.masks[wdw] = None
            else:
                self.masks[wdw] = (qpos[:, None] < kpos[None, :] + wdw)[None, None]
        self.ids = torch.randint(0, V, (a.block,), generator=g, device=dev)

    def step(self):
        a = self.a
        b, H, hd, nh, nkv = a.block, a.hidden, a.head_dim, a.heads, a.kv_heads
        ctx = self.ctx
        h = F.embedding(self.ids, self.embed)  # [b, H]
        for L in self.layers:
            x = rms(h, L["ln1"])
            q = (x @ L["wq"].t()).view(b, nh, hd)
            k = (x @ L["wk"].t()).view(b, nkv, hd)
            v = (x @ L["wv"].t()).view(b, nkv, hd)
            q = rms(q, L["qn"]).transpose(0, 1)[None]  # [1, nh, b, hd]
            k = rms(k, L["kn"]).transpose(0, 1)[None]
            v = v.transpose(0, 1)[None]
            q = rope(q, self.cos, self.sin)
            k = rope(k, self.cos, self.sin)
            L["kc"][:, :, ctx:ctx + b] = k
            L["vc"][:, :, ctx:ctx + b] = v
            o = F.scaled_dot_product_attention(q, L["kc"], L["vc"], attn_mask=self.masks[L["window"]],
                                               enable_gqa=True)
            o = o[0].transpose(0, 1).reshape(b, nh * hd)
            h = h + o @ L["wo"].t()
            x = rms(h, L["ln2"])
            h = h + (F.silu(x @ L["wg"].t()) * (x @ L["wu"].t())) @ L["wd"].t()
        x = rms(h, self.norm)
        logits = x[1:] @ self.lm_head.t()
        return logits.argmax(-1)


def timed(fn, iters, warm=5):
    if not torch.cuda.is_available():  # CPU smoke test of the script itself
        import time
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv-heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--inter", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--windows", type=str, required=True)
    p.add_argument("--ctx", type=str, default="512,8192")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--name", type=str, default="")
    a = p.parse_args()
    a.windows = [None if w == "none" else int(w) for w in a.windows.split(",")]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    for ctx in [int(c) for c in a.ctx.split(",")]:
        m = Drafter(a, ctx, dev)
        with torch.inference_mode():
            eager = timed(m.step, a.iters)
            graph_ms = None
            err = None
            try:
                if dev.type != "cuda":
                    raise RuntimeError("no CUDA device: graph not measured")
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        m.step()
                torch.cuda.current_stream().wait_stream(s)
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    m.step()
                graph_ms = timed(gr.replay, a.iters)
            except Exception as e:  # report, do not hide
                err = repr(e)
        print(json.dumps(dict(name=a.name, ctx=ctx, eager_ms=eager, graph_ms=graph_ms, graph_error=err,
                              torch=torch.__version__,
                              device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")), flush=True)
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

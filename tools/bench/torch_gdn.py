#!/usr/bin/env python3
"""PyTorch peers of a Gated DeltaNet layer's recurrent ops, for `xtask bench gpu --recurrent`.

At each token count T, f32 on the GPU, the shapes of the Qwen3.6-27B target's linear layers:
* the short causal conv (depthwise, kernel 4, then SiLU) over T tokens with a carried state,
  as transformers' fallback computes it (F.conv1d over [state ; x], then SiLU);
* the gated delta rule with q / k L2 norms, from a carried state, returning the final state:
  transformers' `torch_recurrent_gated_delta_rule` (T <= 64) and `torch_chunk_gated_delta_rule`
  (its prefill path; chunks of 64), and flash-linear-attention's Triton kernels
  (`fused_recurrent_gated_delta_rule`, `chunk_gated_delta_rule`, what vLLM and SGLang run)
  where the `fla` package imports. q / k are repeated to the value heads before the timed
  call, as transformers' layer does before calling them.

Median of --iters CUDA-event timings after 2 warm-up calls (torch_drafter.timed). Prints one JSON list on stdout:
[{"t": T, "name": ..., "ms": median}, ...]; a peer that fails is left out (reason on stderr).

usage: torch_gdn.py --t 1,16,512,8192 --k-heads 16 --v-heads 48 --dk 128 --dv 128 --kernel 4
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

from torch_drafter import timed  # the drafter peer's CUDA-event median (same folder)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", default="1,16,512,8192")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=48)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--kernel", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    nk, nv, dk, dv, ker = a.k_heads, a.v_heads, a.dk, a.dv, a.kernel
    ch = 2 * nk * dk + nv * dv
    peers = {}
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        peers["transformers recurrent"] = (m.torch_recurrent_gated_delta_rule, 64)
        peers["transformers chunked"] = (m.torch_chunk_gated_delta_rule, None)
    except Exception as e:  # noqa: BLE001
        print(f"transformers peers: {e}", file=sys.stderr)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        peers["fla fused_recurrent"] = (fused_recurrent_gated_delta_rule, 64)
        peers["fla chunk"] = (chunk_gated_delta_rule, None)
    except Exception as e:  # noqa: BLE001
        print(f"fla peers: {e}", file=sys.stderr)
    out = []
    w = torch.randn(ch, 1, ker, device=dev) * 0.5
    for t in [int(x) for x in a.t.split(",")]:
        x = torch.randn(1, ch, t, device=dev)
        st = torch.randn(1, ch, ker - 1, device=dev)

        def conv():
            y = F.conv1d(torch.cat([st, x], dim=-1), w, groups=ch)
            return F.silu(y), torch.cat([st, x], dim=-1)[..., -(ker - 1):]

        try:
            with torch.inference_mode():
                out.append({"t": t, "name": "conv", "ms": timed(conv, a.iters, warm=2)})
        except Exception as e:  # noqa: BLE001
            print(f"conv T={t}: {e}", file=sys.stderr)
        q = torch.randn(1, t, nk, dk, device=dev).repeat_interleave(nv // nk, dim=2)
        k = torch.randn(1, t, nk, dk, device=dev).repeat_interleave(nv // nk, dim=2)
        v = torch.randn(1, t, nv, dv, device=dev)
        g = -F.softplus(torch.randn(1, t, nv, device=dev))
        beta = torch.sigmoid(torch.randn(1, t, nv, device=dev))
        s0 = torch.randn(1, nv, dk, dv, device=dev) * 0.1
        for name, (fn, max_t) in peers.items():
            if max_t is not None and t > max_t:
                continue
            if name.startswith("fla"):
                call = lambda: fn(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,  # noqa: E731
                                  use_qk_l2norm_in_kernel=True)
            else:
                call = lambda: fn(q, k, v, g, beta, initial_state=s0, output_final_state=True,  # noqa: E731
                                  use_qk_l2norm_in_kernel=True)
            try:
                with torch.inference_mode():
                    out.append({"t": t, "name": name, "ms": timed(call, a.iters, warm=2)})
            except Exception as e:  # noqa: BLE001
                print(f"{name} T={t}: {e}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

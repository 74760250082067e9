#!/usr/bin/env python3
"""PyTorch peer of the hybrid target bench (`xtask bench gpu --hybrid`).

transformers' Qwen3.5 text model (`Qwen3_5ForCausalLM`, Gated DeltaNet + gated full attention)
at the shape the bench builds: the Qwen3.6-27B layers (hidden 5120, MLP 17408, 16 / 48 linear
heads of 128, 24 / 4 attention heads of 256, partial rotary 0.25), 4 layers (3 linear + 1 full),
a 32768-token vocabulary, random bf16 weights on the GPU. Without flash-linear-attention its
Gated DeltaNet layers run transformers' torch fallbacks (`torch_chunk_gated_delta_rule` for a
prompt, the recurrent one for a decode); its attention is SDPA.

At each context P: the prompt's prefill (a fresh cache, logits of the last row only) and a
1-token decode after it (from a copy of the prefilled cache, so every timed decode starts at
P). Median of --iters CUDA-event timings after 2 warm-up calls (torch_drafter.timed). Prints
one JSON list on stdout: [{"p": P, "name": "prefill" | "decode", "ms": median}, ...]; a
context that fails is left out (reason on stderr).

usage: torch_hybrid.py --p 512,8192 --iters 3 [--layers 4 --vocab 32768]
"""
import argparse
import copy
import json
import sys

import torch

from torch_drafter import timed  # the drafter peer's CUDA-event median (same folder)


def build(layers, vocab, dev, dtype, small):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kinds = ["linear_attention"] * (layers - 1) + ["full_attention"]
    if small:  # a CPU smoke test of the script itself
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16)
    else:
        shape = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                     head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                     linear_value_head_dim=128)
    cfg = Qwen3_5TextConfig(vocab_size=vocab, num_hidden_layers=layers, layer_types=kinds, linear_conv_kernel_dim=4,
                            max_position_embeddings=262144, tie_word_embeddings=False, **shape)
    cfg.rope_parameters = {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default"}
    with torch.device(dev):
        model = Qwen3_5ForCausalLM(cfg).to(dtype)
    return model.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--p", default="512,8192")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = build(a.layers, a.vocab, dev, torch.bfloat16 if cuda else torch.float32, small=not cuda)
    out = []
    for p in [int(x) for x in a.p.split(",")]:
        try:
            ids = torch.randint(0, a.vocab, (1, p), device=dev)
            nxt = torch.randint(0, a.vocab, (1, 1), device=dev)
            state = {}

            @torch.inference_mode()
            def prefill():
                r = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                state["cache"] = r.past_key_values

            out.append({"p": p, "name": "prefill", "ms": timed(prefill, a.iters, warm=2)})
            base = state["cache"]

            @torch.inference_mode()
            def decode():
                model(input_ids=nxt, past_key_values=copy.deepcopy(base), use_cache=True, logits_to_keep=1)

            @torch.inference_mode()
            def copy_only():
                copy.deepcopy(base)

            # The cache copy is timed alone and taken off the decode's time.
            d = timed(decode, a.iters, warm=2)
            c = timed(copy_only, a.iters, warm=2)
            out.append({"p": p, "name": "decode", "ms": max(d - c, 0.0)})
        except Exception as e:  # noqa: BLE001
            print(f"torch_hybrid P {p}: {e!r}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Greedy DFlash loop vs plain greedy for the shipped pair in models/ (CPU or GPU, fp32).

Loads models/target (HF Qwen3ForCausalLM) and models/draft (z-lab layout) from disk, runs
prompts of models/prompts-heldout.jsonl, prints per-prompt tau and whether the speculative
stream equals plain greedy, then tau pooled over rounds and the mean of per-prompt tau
(prompts that end at once with EOS, zero rounds, are left out of the mean)."""
import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dflash_torch import DFlashDraft, plain_greedy, spec_greedy  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="models")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    target = Qwen3ForCausalLM.from_pretrained(os.path.join(a.models, "target"), dtype=torch.float32).to(dev).eval()
    dc = json.load(open(os.path.join(a.models, "draft", "config.json")))
    draft = DFlashDraft(dc)
    sd = load_file(os.path.join(a.models, "draft", "model.safetensors"))
    draft.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    draft.to(dev).eval()
    eos = target.config.eos_token_id
    prompts = [json.loads(l) for l in open(os.path.join(a.models, "prompts-heldout.jsonl"))]
    prompts = prompts[a.first: a.first + a.prompts]
    rows, all_lens = [], []
    for i, p in enumerate(prompts):
        t0 = time.time()
        gen, lens = spec_greedy(target, draft, p["ids"], a.max_new, eos)
        t1 = time.time()
        ref = plain_greedy(target, p["ids"], a.max_new, eos)
        t2 = time.time()
        tau = sum(lens) / len(lens) if lens else None
        rows.append({"prompt": a.first + i, "tokens": len(gen), "rounds": len(lens), "tau": tau,
                     "identical": gen == ref, "spec_s": t1 - t0, "plain_s": t2 - t1})
        all_lens += lens
        print(json.dumps(rows[-1]), flush=True)
    taus = [r["tau"] for r in rows if r["tau"] is not None]
    summary = {"prompts": len(rows), "tau_pooled": sum(all_lens) / max(1, len(all_lens)),
               "tau_mean_per_prompt": sum(taus) / max(1, len(taus)),
               "identical": sum(r["identical"] for r in rows)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

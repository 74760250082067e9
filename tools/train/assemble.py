#!/usr/bin/env python3
"""Turn a pipeline run's output (metrics.json, target_a/b.safetensors, draft.safetensors) and
the corpus folder (tokenizer.json, prompts-heldout.jsonl) into the shipped models/ folder:
  models/target/{config.json, model.safetensors, tokenizer.json, generation_config.json}
  models/draft/{config.json, model.safetensors}
  models/prompts-heldout.jsonl
and check that HF loads the target and that the drafter has exactly the z-lab tensor names."""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--models", required=True)
    a = ap.parse_args()
    m = json.load(open(os.path.join(a.run, "metrics.json")))
    td, dd = os.path.join(a.models, "target"), os.path.join(a.models, "draft")
    os.makedirs(td, exist_ok=True)
    os.makedirs(dd, exist_ok=True)

    tc = dict(m["target_config"])
    tc["dtype"] = "bfloat16"
    tc["architectures"] = ["Qwen3ForCausalLM"]
    cfg = Qwen3Config(**{k: v for k, v in tc.items() if k not in ("transformers_version",)})
    cfg.architectures = ["Qwen3ForCausalLM"]
    sd = load_file(os.path.join(a.run, "target_a.safetensors"))
    sd.update(load_file(os.path.join(a.run, "target_b.safetensors")))
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    save_file(dict(sorted(sd.items())), os.path.join(td, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(td)
    # also a top-level rope_theta for loaders that read the transformers-4 schema
    cj = json.load(open(os.path.join(td, "config.json")))
    cj["rope_theta"] = cj.get("rope_parameters", {}).get("rope_theta", 10000.0)
    json.dump(cj, open(os.path.join(td, "config.json"), "w"), indent=2, sort_keys=True)
    shutil.copy(os.path.join(a.data, "tokenizer.json"), os.path.join(td, "tokenizer.json"))
    # HF load check (bf16 weights, tied lm_head)
    model = Qwen3ForCausalLM.from_pretrained(td, dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(model.model.embed_tokens.weight, sd["model.embed_tokens.weight"].float())
    n_t = sum(p.numel() for p in model.parameters())

    dc = m["draft_config"]
    json.dump(dc, open(os.path.join(dd, "config.json"), "w"), indent=2)
    dsd = load_file(os.path.join(a.run, "draft.safetensors"))
    d, L = dc["hidden_size"], dc["num_hidden_layers"]
    H, Hkv, hd, I = dc["num_attention_heads"], dc["num_key_value_heads"], dc["head_dim"], dc["intermediate_size"]
    mm = len(dc["dflash_config"]["target_layer_ids"])
    want = {"fc.weight": [d, mm * d], "hidden_norm.weight": [d], "norm.weight": [d]}
    for i in range(L):
        p = f"layers.{i}."
        want.update({
            p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d],
            p + "self_attn.q_proj.weight": [H * hd, d], p + "self_attn.k_proj.weight": [Hkv * hd, d],
            p + "self_attn.v_proj.weight": [Hkv * hd, d], p + "self_attn.o_proj.weight": [d, H * hd],
            p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
            p + "mlp.gate_proj.weight": [I, d], p + "mlp.up_proj.weight": [I, d], p + "mlp.down_proj.weight": [d, I],
        })
    got = {k: list(v.shape) for k, v in dsd.items()}
    assert got == want, (set(got) ^ set(want))
    assert all(v.dtype == torch.bfloat16 for v in dsd.values())
    save_file(dict(sorted(dsd.items())), os.path.join(dd, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(a.data, "prompts-heldout.jsonl"), os.path.join(a.models, "prompts-heldout.jsonl"))
    print(f"target params {n_t}, draft params {sum(v.numel() for v in dsd.values())}")
    for root, _, files in os.walk(a.models):
        for f in sorted(files):
            p = os.path.join(root, f)
            print(f"{os.path.getsize(p):>10}  {p}")


if __name__ == "__main__":
    main()

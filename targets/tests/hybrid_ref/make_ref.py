"""Reference dumps for the hybrid target tests (targets/tests/hybrid_*.rs).

Tiny random transformers 5.17 models (Qwen3.5 text-only, the Qwen3.5 vision-language layout,
Qwen3-Next with its fused projections), saved with `save_pretrained` in f32, and what
transformers computes for them:

* `prompt_logits` [P, V] and `hidden_states` [L+1, P, d]: one prefill forward (transformers
  runs the chunked gated delta rule there);
* `step_logits` [P, V]: the same prompt fed one token at a time through the cache
  (transformers runs the recurrent gated delta rule there, the form the Rust target uses);
* `prompt_logits_f64` [P, V], `hidden_states_f64` [L+1, P, d]: the prefill forward of the same
  weights in float64 (what both f32 computations approximate; used to justify the f32 bound);
* `greedy_ids` [N]: `generate` greedy continuation, the first predicted from the prompt.

Every parameter is re-drawn at a scale where the logits are O(1) (the default init gives
near-flat logits and zero-centred norms of exactly 0, which would hide bugs in the norm folds).

Usage: /work/pyenv/bin/python targets/tests/hybrid_ref/make_ref.py   (writes next to itself)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
N_NEW = 12


def randomize(model, seed, embed_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # zero-centred (1 + w) RMSNorms
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * embed_scale)
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def run_case(case, model, text_model_of, arch, desc, prompt_len, seed, embed_scale=1.0):
    out = os.path.join(HERE, case)
    os.makedirs(out, exist_ok=True)
    randomize(model, seed, embed_scale)
    model.eval()
    if any("experts" in n for n, _ in model.named_parameters()):
        # The reference per-expert loop (the default grouped_mm path has no float64 kernel).
        model.set_experts_implementation("eager")
    model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    vocab = text_model_of(model).config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
    with torch.no_grad():
        o = model(input_ids=prompt, output_hidden_states=True, use_cache=False)
        logits = o.logits[0].float()
        hs = torch.stack([h[0] for h in o.hidden_states]).float()
        # token-by-token through the cache (recurrent form)
        from transformers import DynamicCache

        cache = DynamicCache(config=text_model_of(model).config)
        steps = []
        for i in range(prompt_len):
            so = model(input_ids=prompt[:, i : i + 1], past_key_values=cache, use_cache=True)
            cache = so.past_key_values
            steps.append(so.logits[0, -1].float())
        step_logits = torch.stack(steps)
        gen = model.generate(
            prompt, max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0
        )
        # float64 reference of the same weights: what both f32 computations approximate
        m64 = model.to(torch.float64)
        o64 = m64(input_ids=prompt, use_cache=False, output_hidden_states=True)
        logits64 = o64.logits[0].float()
        hs64 = torch.stack([h[0] for h in o64.hidden_states]).float()
        model.to(torch.float32)
    greedy = gen[0, prompt_len:]
    save_file(
        {
            "prompt_ids": prompt[0].to(torch.int64).contiguous(),
            "prompt_logits": logits.contiguous(),
            "step_logits": step_logits.contiguous(),
            "prompt_logits_f64": logits64.contiguous(),
            "hidden_states_f64": hs64.contiguous(),
            "hidden_states": hs.contiguous(),
            "greedy_ids": greedy.to(torch.int64).contiguous(),
        },
        os.path.join(out, "io.safetensors"),
    )
    with open(os.path.join(out, "case.json"), "w") as f:
        json.dump({"arch": arch, "n_new": N_NEW, "description": desc}, f, indent=1)
    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    print(f"{case}: prompt {prompt_len}, greedy {greedy.tolist()}, rel errors: chunked vs recurrent "
          f"{rel(logits, step_logits):.2e}, chunked vs f64 {rel(logits, logits64):.2e}, "
          f"recurrent vs f64 {rel(step_logits, logits64):.2e}")


def main():
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(0)
    text = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    run_case("qwen3_5_text", m, lambda m: m, "qwen3_5_text",
             "Qwen3_5ForCausalLM, 6 layers (linear, linear, full) x 2, GQA 4/2 value/key heads", 40, 10)

    vl_text = dict(text, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    m = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=vl_text,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)))
    run_case("qwen3_5_vl", m, lambda m: m.model.language_model, "qwen3_5",
             "Qwen3_5ForConditionalGeneration (nested text_config, model.language_model.* names, vision tower present)", 24, 20)

    nxt = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        linear_conv_kernel_dim=3,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        num_experts=0,
        full_attention_interval=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    m = Qwen3NextForCausalLM(Qwen3NextConfig(**nxt))
    run_case("qwen3_next_dense", m, lambda m: m, "qwen3_next",
             "Qwen3NextForCausalLM with num_experts = 0 (dense MLP), fused in_proj_qkvz / in_proj_ba, tied embeddings, 3 value heads per key head, conv kernel 3", 30, 30, 0.1)

    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    moe = dict(nxt, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
               shared_expert_intermediate_size=40, mlp_only_layers=[2], tie_word_embeddings=False)
    m = Qwen3NextForCausalLM(Qwen3NextConfig(**moe))
    run_case("qwen3_next_moe", m, lambda m: m, "qwen3_next",
             "Qwen3NextForCausalLM with the sparse MoE block (6 experts, top-2, shared expert) on layers 0, 1, 3 and a dense MLP on layer 2 (mlp_only_layers)", 24, 40)

    q35moe = {k: v for k, v in text.items() if k != "intermediate_size"}
    q35moe.update(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                  num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**q35moe))
    run_case("qwen3_5_moe_text", m, lambda m: m, "qwen3_5_moe_text",
             "Qwen3_5MoeForCausalLM: every layer a sparse MoE block (4 experts, top-3, renormalised, shared expert)", 24, 50)


if __name__ == "__main__":
    sys.exit(main())

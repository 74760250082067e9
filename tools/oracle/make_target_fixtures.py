"""Target fixtures: tiny random transformers 5.17 checkpoints + their own outputs.

Cases (targets/tests/fixtures/<case>/):
  qwen3_dense      Qwen3ForCausalLM (the same target the drafter fixtures use)
  qwen3_5_hybrid   Qwen3_5ForCausalLM: Gated DeltaNet linear-attention layers + gated full attention
  qwen3_5_vl_text  Qwen3_5ForConditionalGeneration (tiny vision tower), text-only prompt: the VL checkpoint
                   layout (nested text_config, model.language_model.* names, model.visual.* to skip)

Each: model/{config.json, model.safetensors} (save_pretrained, bf16 storage of bf16-representable weights),
io.safetensors (prompt_ids, prompt_logits, hidden_states, greedy_ids, greedy_logits, + hybrid state after the
prompt), case.json. Everything computed by transformers itself in float32, eager attention.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import torch
from safetensors.torch import save_file

import make_fixtures as MF

P_LEN = 40
N_NEW = 24


def hybrid_text_config_kwargs(seed_layers=None):
    return dict(
        vocab_size=MF.VOCAB,
        hidden_size=MF.HIDDEN,
        intermediate_size=256,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        tie_word_embeddings=False,
        initializer_range=0.05,
        attention_bias=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def realistic_gdn_(model, gen):
    """HF's GDN init (A in U(0.01,16), dt_bias 1) decays the state to ~0 every step; use values that keep
    long memory (A in U(0.1,1), dt_bias in U(-4,-1): decay exp(g) mostly 0.75..0.999 per token) and a conv
    with O(1) taps, so the recurrence is exercised. Gentle decays also keep transformers' float32 chunked
    kernel (exp of cumulative log-decays) accurate to ~2e-6."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.log(0.1 + 0.9 * torch.rand(p.shape, generator=gen)))
            elif n.endswith("dt_bias"):
                p.copy_(-4.0 + 3.0 * torch.rand(p.shape, generator=gen))
            elif n.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def finish_model_(model, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    MF.perturb_norms_(model, gen)
    realistic_gdn_(model, gen)
    MF.bf16_round_(model)
    return model.eval()


def make_hybrid(seed):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(**hybrid_text_config_kwargs())
    cfg._attn_implementation = "eager"
    return finish_model_(Qwen3_5ForCausalLM(cfg).to(torch.float32), seed)


def make_vl(seed):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = hybrid_text_config_kwargs()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=MF.HIDDEN, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=MF.VOCAB - 4,
                        video_token_id=MF.VOCAB - 3, vision_start_token_id=MF.VOCAB - 6,
                        vision_end_token_id=MF.VOCAB - 5, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    return finish_model_(Qwen3_5ForConditionalGeneration(cfg).to(torch.float32), seed)


def greedy(model, ids, n):
    """transformers' own greedy decode (generate, do_sample=False, with the model's cache), plus the logits of
    every step; cross-checked against argmax of a no-cache forward over the growing sequence."""
    with torch.no_grad():
        out = model.generate(input_ids=ids[None], attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    new = out.sequences[0, ids.shape[0]:]
    logits = torch.stack([lg[0].float() for lg in out.logits])
    with torch.no_grad():
        full = model(input_ids=out.sequences[:, :-1], use_cache=False).logits[0, ids.shape[0] - 1:].float()
    assert torch.equal(torch.argmax(full, -1), new), "cached generate and no-cache argmax disagree"
    return new, logits, full


def prompt_forward(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=True)
    hs = torch.stack([h[0].float() for h in out.hidden_states])
    return out.logits[0].float(), hs, out.past_key_values


def save_model_bf16(model, model_dir):
    if os.path.isdir(model_dir):
        shutil.rmtree(model_dir)
    # a copy: .to(bfloat16) would also round the model's rotary inv_freq buffers
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16.save_pretrained(model_dir, safe_serialization=True)
    # generation_config.json is not part of the fixture format
    gc = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)


def linear_states(model_cfg, cache):
    st = {}
    text_cfg = getattr(model_cfg, "text_config", model_cfg)
    for i, t in enumerate(text_cfg.layer_types):
        if t == "linear_attention":
            layer = cache.layers[i]
            st[f"conv_state.{i}"] = layer.conv_states[0][0].float()
            st[f"recurrent_state.{i}"] = layer.recurrent_states[0][0].float()
    return st


def write_case(name, arch, model, out_root, ids, description, log, extra=None):
    case_dir = os.path.join(out_root, name)
    os.makedirs(case_dir, exist_ok=True)
    logits, hs, cache = prompt_forward(model, ids)
    new, glogits, full = greedy(model, ids, N_NEW)
    assert torch.equal(torch.argmax(logits[-1]), new[0])
    top = torch.topk(glogits, 2, dim=-1).values
    margin = float((top[:, 0] - top[:, 1]).min())
    io = {"prompt_ids": ids, "prompt_logits": logits, "hidden_states": hs, "greedy_ids": new,
          "greedy_logits": glogits}
    if arch == "qwen3_5":
        io.update(linear_states(model.config, cache))
    io = {k: (v.to(torch.float32) if v.is_floating_point() else v.to(torch.int64)).contiguous() for k, v in io.items()}
    save_file(io, os.path.join(case_dir, "io.safetensors"), metadata={"format": "pt"})
    save_model_bf16(model, os.path.join(case_dir, "model"))
    # error gauge: transformers' float32 logits against a float64 computation of the same weights
    if arch == "qwen3_5":
        import hybrid_ref

        ref64 = hybrid_ref.run_prompt(os.path.join(case_dir, "model"), ids, torch.float64)
        gauge = "hybrid_ref.py (token-by-token re-implementation from the README notes) in float64"
    else:
        m64 = copy.deepcopy(model).to(torch.float64)
        with torch.no_grad():
            ref64 = m64(input_ids=ids[None], use_cache=False).logits[0]
        gauge = "transformers in float64"
    case = {"arch": arch, "n_new": N_NEW, "description": description, "prompt_len": int(ids.shape[0]),
            "storage_dtype": "bfloat16", "compute_dtype": "float32", "min_greedy_margin": margin,
            "cached_vs_nocache_greedy_logits_max_rel": MF.max_rel(glogits, full),
            "prompt_logits_f32_vs_f64_max_rel": MF.max_rel(logits, ref64), "f64_gauge": gauge}
    if extra:
        case.update(extra)
    with open(os.path.join(case_dir, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
    size = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(case_dir) for fn in fns)
    log(f"{name}: {size / 1e6:.2f} MB, greedy margin {margin:.4f}, prompt logits f32 vs f64 "
        f"{case['prompt_logits_f32_vs_f64_max_rel']:.1e}, greedy {new.tolist()}")
    return size


def make_target_fixtures(out_root, only=None, log=print):
    total = 0
    if not only or "qwen3_dense" in only:
        m = MF.make_qwen3_target()
        ids = MF.prompt(7001, P_LEN)
        total += write_case("qwen3_dense", "qwen3", m, out_root, ids,
                            "transformers Qwen3ForCausalLM, 6 layers, hidden 128, 4/2 heads, head_dim 32, vocab 512, "
                            "untied lm_head; the same target as the drafter fixtures (seed 1234)", log)
    if not only or "qwen3_5_hybrid" in only:
        for attempt in range(20):
            m = make_hybrid(4321 + attempt)
            ids = MF.prompt(7002, P_LEN)
            new, glogits, _ = greedy(m, ids, N_NEW)
            top = torch.topk(glogits, 2, dim=-1).values
            if float((top[:, 0] - top[:, 1]).min()) >= 1e-3:
                break
        total += write_case("qwen3_5_hybrid", "qwen3_5", m, out_root, ids,
                            "transformers Qwen3_5ForCausalLM (text), 5 layers [linear, linear, full, linear, full], "
                            "hidden 128; GDN: 2 k heads / 4 v heads, head dims 32, conv kernel 4; full attention: "
                            "4/2 heads, head_dim 64, output gate, partial_rotary_factor 0.25, theta 1e7",
                            log, {"seed": 4321 + attempt})
    if not only or "qwen3_5_vl_text" in only:
        for attempt in range(20):
            m = make_vl(9876 + attempt)
            ids = MF.prompt(7003, P_LEN, MF.VOCAB - 8)  # avoid the image/video/vision special ids
            new, glogits, _ = greedy(m, ids, N_NEW)
            top = torch.topk(glogits, 2, dim=-1).values
            if float((top[:, 0] - top[:, 1]).min()) >= 1e-3:
                break
        total += write_case("qwen3_5_vl_text", "qwen3_5", m, out_root, ids,
                            "transformers Qwen3_5ForConditionalGeneration with a 1-block vision tower, text-only "
                            "prompt: config nests text_config (same shape as qwen3_5_hybrid, other weights), "
                            "tensors model.language_model.*, lm_head.weight, and model.visual.* (to skip)",
                            log, {"seed": 9876 + attempt})
    log(f"target fixtures total: {total / 1e6:.2f} MB")

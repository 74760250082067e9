"""Write the oracle fixtures (see fixture-format in tools/oracle/README.md).

Usage:
    python tools/oracle/make_fixtures.py [--draft-out DIR] [--targets-out DIR] [--only draft|targets] [--cases a,b]

Defaults: draft-model/tests/fixtures and targets/tests/fixtures of the repository.
Everything is seeded; a rerun with the same package versions writes identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_oracle as O  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# The tiny Qwen3 target shared by all drafter cases (and the qwen3_dense target case).
VOCAB = 512
HIDDEN = 128
T_LAYERS = 6
MASK_ID = VOCAB - 1
TARGET_SEED = 1234


def bf16_round_(model: torch.nn.Module):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def perturb_norms_(model: torch.nn.Module, gen: torch.Generator, scale: float = 0.2):
    """HF inits RMSNorm weights to a constant; perturb them so a missing weight multiply is caught."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1 and "norm" in n:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def qwen3_target_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=256,
        num_hidden_layers=T_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        initializer_range=0.05,
        attention_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def make_qwen3_target():
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(TARGET_SEED)
    cfg = qwen3_target_config()
    cfg._attn_implementation = "eager"
    model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(TARGET_SEED + 1)
    perturb_norms_(model, gen)
    bf16_round_(model)
    return model


def prompt(seed: int, n: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (n,), generator=g)  # never the mask id (vocab-1)


def run_target(model, ids: torch.Tensor):
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), [h[0].float() for h in out.hidden_states]


def taps_from(hs: list[torch.Tensor], ids: list[int], n_layers: int) -> torch.Tensor:
    """Concatenate HF hidden_states[l+1] in list order (l = -1: embedding output; l = L-1 invalid)."""
    for l in ids:
        assert -1 <= l <= n_layers - 2, f"invalid tap layer {l}"
    return torch.cat([hs[l + 1] for l in ids], dim=-1)


# ----------------------------------------------------------------------------------------------
# Drafter cases
# ----------------------------------------------------------------------------------------------


def draft_config_base(n_layers: int, vocab: int = VOCAB, hidden: int = HIDDEN):
    return {
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "bfloat16",
        "model_type": "qwen3",
        "transformers_version": "5.17.0",
    }


def make_draft_tensors(cfg: dict, m: int, seed: int, markov_rank: int = 0, confidence: bool = False,
                       with_embed: torch.Tensor | None = None, with_head: torch.Tensor | None = None):
    """Random drafter weights with realistic scale: linears N(0, 1/fan_in), norms U(0.5, 1.5), q/k norms U(0.75, 2.25)."""
    g = torch.Generator().manual_seed(seed)
    d = cfg["hidden_size"]
    H, Hkv, hd, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]

    def lin(o, i):
        return torch.randn(o, i, generator=g) / (i**0.5)

    def norm(n):
        return 0.5 + torch.rand(n, generator=g)

    t = {"fc.weight": lin(d, m * d), "hidden_norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = lin(H * hd, d)
        t[p + "self_attn.k_proj.weight"] = lin(Hkv * hd, d)
        t[p + "self_attn.v_proj.weight"] = lin(Hkv * hd, d)
        t[p + "self_attn.o_proj.weight"] = lin(d, H * hd)
        # larger q/k norm gains: sharper attention, so block rows differ by position (RoPE)
        t[p + "self_attn.q_norm.weight"] = 1.5 * norm(hd)
        t[p + "self_attn.k_norm.weight"] = 1.5 * norm(hd)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "mlp.gate_proj.weight"] = lin(inter, d)
        t[p + "mlp.up_proj.weight"] = lin(inter, d)
        t[p + "mlp.down_proj.weight"] = lin(d, inter)
    t["norm.weight"] = norm(d)
    V = cfg["vocab_size"]
    if markov_rank:
        t["markov_head.markov_w1.weight"] = torch.randn(V, markov_rank, generator=g)
        t["markov_head.markov_w2.weight"] = torch.randn(V, markov_rank, generator=g) * (0.5 / markov_rank**0.5)
    if confidence:
        n_in = d + markov_rank
        t["confidence_head.proj.weight"] = torch.randn(1, n_in, generator=g) / (n_in**0.5)
        t["confidence_head.proj.bias"] = torch.randn(1, generator=g) * 0.1
    if with_embed is not None:
        t["embed_tokens.weight"] = with_embed.clone()
    if with_head is not None:
        t["lm_head.weight"] = with_head.clone()
    return {k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}


def min_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max(|b|) per tensor (the scale-relative error the Rust tests use)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def compute_draft_case(draft_dir, precision, taps, block, embed, lm_head, dtype):
    cfg, W = O.load_draft(draft_dir, precision=precision, dtype=dtype)
    c, outs, z = O.full_forward(W, taps, block, embed)
    lg = O.draft_logits(cfg, z, lm_head)
    res = {"ctx_features": c, "final_hidden": z, "draft_logits": lg}
    for i, o in enumerate(outs):
        res[f"layer{i}_out"] = o
    res["draft_tokens"] = torch.argmax(lg, dim=-1)
    if W.get("markov_head.markov_w1.weight") is not None or W.get("confidence_head.proj.weight") is not None:
        ml, mt, conf = O.markov_chain(W, lg, O.draft_rows(cfg, z), int(block[0]))
        if W.get("markov_head.markov_w1.weight") is not None:
            res["markov_logits"] = ml
            res["markov_tokens"] = mt
        if conf is not None:
            res["confidence_logits"] = conf
    return cfg, W, res


DRAFT_CASES = {
    "dflash_plain": dict(
        description="z-lab DFlash layout, 2 full-attention layers, m=3 taps [0,2,4] (nested dflash_config), "
        "block 16, ctx 24, rope_theta top level (transformers-4 style), bf16 weights computed in f32",
        n_layers=2, block=16, ctx=24, precision="f32", seed=11,
        cfg=lambda: {"block_size": 16, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2, 4]},
                     "rope_theta": 1000000.0, "rope_scaling": None,
                     "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False},
    ),
    "dflash_swa": dict(
        description="z-lab DFlash layout, 3 layers [sliding, full, sliding], sliding_window 8 < ctx 40, block 8 "
        "(block_size nested in dflash_config), m=2 taps [1,3], transformers-5 rope_parameters; sliding layers: "
        "query at p sees keys at q with p-8 < q <= p (ctx and block rows), full layer: no mask",
        n_layers=3, block=8, ctx=40, precision="f32", seed=22,
        cfg=lambda: {"dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3], "block_size": 8},
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "sliding_window": 8, "use_sliding_window": True},
    ),
    "dflash_yarn": dict(
        description="z-lab DFlash layout, 2 full layers, rope_scaling yarn (factor 4, original_max_position_embeddings "
        "2048, theta 1e6, head_dim 32: ramp dims 2..7, attention_factor 1+0.1 ln 4); no target_layer_ids in the "
        "config: the default rule with num_target_layers 6 and 2 draft layers gives [1,3]; block 16, ctx 24",
        n_layers=2, block=16, ctx=24, precision="f32", seed=33,
        cfg=lambda: {"block_size": 16, "dflash_config": {"mask_token_id": MASK_ID},
                     "rope_theta": 1000000.0, "max_position_embeddings": 8192,
                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
                     "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False},
    ),
    "dspark_markov": dict(
        description="DeepSpec Qwen3DSparkModel: anchor-predicts layout (rows 0..6 -> 7 drafts), block 7, top-level "
        "mask_token_id / target_layer_ids [-1,2,4] (-1 = embedding output), vanilla Markov head rank 32, "
        "confidence head with Markov ([z_k ; w1[prev_k]]), embed_tokens/lm_head copies of the target's in the "
        "checkpoint; 2 full layers, ctx 24",
        n_layers=2, block=7, ctx=24, precision="f32", seed=44, markov_rank=32, confidence=True,
        cfg=lambda: {"architectures": ["Qwen3DSparkModel"], "block_size": 7, "mask_token_id": MASK_ID,
                     "target_layer_ids": [-1, 2, 4], "num_anchors": 512, "enable_confidence_head": True,
                     "confidence_head_with_markov": True, "markov_rank": 32, "markov_head_type": "vanilla",
                     "rope_theta": 1000000.0, "rope_scaling": None,
                     "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False},
    ),
    "dflash_q8_0": dict(
        description="as dflash_plain (other seed) with precision q8_0: fc, q/k/v/o, gate/up/down quantized with "
        "gguf 0.19.0 quantize+dequantize from the bf16 values; norms f32",
        n_layers=2, block=16, ctx=24, precision="q8_0", seed=55,
        cfg=lambda: {"block_size": 16, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2, 4]},
                     "rope_theta": 1000000.0, "rope_scaling": None,
                     "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False},
    ),
    "dflash_q4_0": dict(
        description="as dflash_plain (other seed) with precision q4_0 (same linears as q8_0), gguf 0.19.0 "
        "quantize+dequantize; no all-zero blocks",
        n_layers=2, block=16, ctx=24, precision="q4_0", seed=66,
        cfg=lambda: {"block_size": 16, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2, 4]},
                     "rope_theta": 1000000.0, "rope_scaling": None,
                     "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False},
    ),
    "dflash_mixed": dict(
        description="as dflash_plain (other seed) with precision mixed: attention q/k/v/o and fc stay bf16 (upcast), "
        "MLP gate/up/down q8_0 via gguf 0.19.0 quantize+dequantize",
        n_layers=2, block=16, ctx=24, precision="mixed", seed=77,
        cfg=lambda: {"block_size": 16, "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2, 4]},
                     "rope_theta": 1000000.0, "rope_scaling": None,
                     "layer_types": ["full_attention"] * 2, "sliding_window": None, "use_sliding_window": False},
    ),
}


def write_draft_case(name, spec, target, out_root, log):
    case_dir = os.path.join(out_root, name)
    draft_dir = os.path.join(case_dir, "draft")
    os.makedirs(draft_dir, exist_ok=True)
    embed = target.model.embed_tokens.weight.detach().float()
    lm_head = target.lm_head.weight.detach().float()
    ctx, b = spec["ctx"], spec["block"]
    ids = prompt(1000 + spec["seed"], ctx)
    tlogits, hs = run_target(target, ids)
    anchor = int(torch.argmax(tlogits[-1]))
    block = torch.full((b,), MASK_ID, dtype=torch.long)
    block[0] = anchor

    cfgd = draft_config_base(spec["n_layers"])
    cfgd.update({"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                 "num_target_layers": T_LAYERS})
    cfgd.update(spec["cfg"]())
    pc = O.parse_config(cfgd)
    m = len(pc.target_layer_ids)
    taps = taps_from(hs, pc.target_layer_ids, T_LAYERS)

    mr = spec.get("markov_rank", 0)
    seed = spec["seed"]
    for attempt in range(50):
        tensors = make_draft_tensors(cfgd, m, seed + 1000 * attempt, mr, spec.get("confidence", False),
                                     embed if mr else None, lm_head if mr else None)
        save_file(tensors, os.path.join(draft_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(draft_dir, "config.json"), "w") as f:
            json.dump(cfgd, f, indent=2)
        cfg, W, res = compute_draft_case(draft_dir, spec["precision"], taps, block, embed, lm_head, torch.float32)
        margins = [min_margin(res["draft_logits"])]
        if "markov_logits" in res:
            margins.append(min_margin(res["markov_logits"]))
        if min(margins) >= 5e-3:
            break
    else:
        raise RuntimeError(f"{name}: no seed with a clear argmax margin")
    # float64 reference for the error budget
    _, _, res64 = compute_draft_case(draft_dir, spec["precision"], taps.double(), block, embed.double(), lm_head.double(), torch.float64)
    f32_vs_f64 = {k: max_rel(res[k], res64[k]) for k in res if res[k].is_floating_point()}
    for k in res:
        if not res[k].is_floating_point():
            assert torch.equal(res[k], res64[k]), f"{name}: {k} differs between f32 and f64"

    # cached == uncached: ingest ctx in uneven chunks, then the block
    cache = O.DraftCache(W)
    cuts = [0, 5, 17, ctx] if ctx > 17 else [0, ctx]
    for a, bb in zip(cuts[:-1], cuts[1:]):
        cache.ingest(taps[a:bb], a)
    outs_c, z_c = O.block_forward(W, cache, block, embed, ctx)
    cached_diff = max(max_rel(z_c, res["final_hidden"]),
                      max(max_rel(o, res[f"layer{i}_out"]) for i, o in enumerate(outs_c)))
    # float32 BLAS blocking differs with the chunking; the strict (float64, 1e-12) check is in selfcheck.py
    assert cached_diff <= 5e-6, f"{name}: cached vs uncached max rel {cached_diff}"

    io = {
        "target_embed": embed, "target_lm_head": lm_head, "taps": taps, "prompt_ids": ids,
        "block_tokens": block,
    }
    io.update(res)
    io = {k: (v.to(torch.float32) if v.is_floating_point() else v.to(torch.int64)).contiguous() for k, v in io.items()}
    save_file(io, os.path.join(case_dir, "io.safetensors"), metadata={"format": "pt"})
    case = {
        "ctx_len": ctx, "block_size": b, "layout": cfg.layout, "precision": spec["precision"],
        "markov": "markov_logits" in res, "confidence": "confidence_logits" in res,
        "description": spec["description"],
        "target_layer_ids": cfg.target_layer_ids, "mask_token_id": cfg.mask_token_id,
        "draft_seed": seed + 1000 * attempt, "target_seed": TARGET_SEED,
        "min_argmax_margin": min(margins),
        "f32_vs_f64_max_rel": f32_vs_f64, "cached_vs_uncached_max_rel": cached_diff,
    }
    with open(os.path.join(case_dir, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
    size = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(case_dir) for fn in fns)
    log(f"{name}: {size / 1e6:.2f} MB, margin {min(margins):.4f}, cached-vs-uncached {cached_diff:.2e}, "
        f"f32-vs-f64 max rel {max(f32_vs_f64.values()):.2e}, drafts {res['draft_tokens'].tolist()}")
    rel, _ = O.check_inv_freq(cfg)
    case["inv_freq_vs_transformers_max_rel"] = rel
    with open(os.path.join(case_dir, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
    if True:
        log(f"  inv_freq ({cfg.rope.rope_type}) vs transformers ROPE_INIT_FUNCTIONS: max rel {rel:.2e}")
    return size


def make_draft_fixtures(out_root, only_cases=None, log=print):
    target = make_qwen3_target()
    total = 0
    for name, spec in DRAFT_CASES.items():
        if only_cases and name not in only_cases:
            continue
        total += write_draft_case(name, spec, target, out_root, log)
    log(f"drafter fixtures total: {total / 1e6:.2f} MB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-out", default=os.path.join(REPO, "draft-model", "tests", "fixtures"))
    ap.add_argument("--targets-out", default=os.path.join(REPO, "targets", "tests", "fixtures"))
    ap.add_argument("--only", choices=["draft", "targets"])
    ap.add_argument("--cases", default="")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    only = set(c for c in args.cases.split(",") if c)
    if args.only in (None, "draft"):
        make_draft_fixtures(args.draft_out, only)
    if args.only in (None, "targets"):
        import make_target_fixtures as T

        T.make_target_fixtures(args.targets_out, only)


if __name__ == "__main__":
    main()

"""Self-checks of the oracle against itself and against transformers.

For every drafter fixture case (default: draft-model/tests/fixtures):
  * inv_freq (ours, float64 from semantics sec. 6) vs transformers ROPE_INIT_FUNCTIONS / default init, <= 1e-7 rel;
  * cos/sin tables (with the YaRN attention factor) vs transformers' Qwen3RotaryEmbedding, <= 2 f32 ulp of the angle;
  * cached (context ingested one row at a time, then in uneven chunks) vs uncached forward in float64, <= 1e-12 rel;
  * recomputation from the stored checkpoint + io equals the stored expectations (<= 1e-6 rel; tokens equal).
Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_oracle as O  # noqa: E402
from make_fixtures import REPO, compute_draft_case, max_rel  # noqa: E402


def check_case(case_dir: str) -> list[str]:
    fails = []
    case = json.load(open(os.path.join(case_dir, "case.json")))
    io = load_file(os.path.join(case_dir, "io.safetensors"))
    draft_dir = os.path.join(case_dir, "draft")
    cfg, W, res = compute_draft_case(draft_dir, case["precision"], io["taps"], io["block_tokens"],
                                     io["target_embed"], io["target_lm_head"], torch.float32)
    rel, _ = O.check_inv_freq(cfg)
    ctx, b = case["ctx_len"], case["block_size"]
    rope_abs = O.check_rope_tables(cfg, torch.arange(0, ctx + b))
    # transformers builds the angles in float32: allow 2 ulp of the largest angle
    if rope_abs > 2 * (ctx + b) * 2.0**-23:
        fails.append(f"rope tables vs transformers {rope_abs}")
    worst = 0.0
    for k, v in res.items():
        if v.is_floating_point():
            e = max_rel(v, io[k])
            worst = max(worst, e)
            if e > 1e-6:
                fails.append(f"{k} recomputed max rel {e}")
        elif not torch.equal(v, io[k]):
            fails.append(f"{k} tokens differ")
    # cached vs uncached, in float64 (semantic equality: float32 would only measure BLAS blocking noise)
    _, W64 = O.load_draft(draft_dir, precision=case["precision"], dtype=torch.float64)
    taps64, emb64 = io["taps"].double(), io["target_embed"].double()
    _, outs_u, z_u = O.full_forward(W64, taps64, io["block_tokens"], emb64)
    cache_errs = []
    for cuts in (list(range(ctx + 1)), [0, 3, 11, ctx]):
        cache = O.DraftCache(W64)
        for a, bb in zip(cuts[:-1], cuts[1:]):
            cache.ingest(taps64[a:bb], a)
        outs, z = O.block_forward(W64, cache, io["block_tokens"], emb64, ctx)
        e = max([max_rel(z, z_u)] + [max_rel(o, u) for o, u in zip(outs, outs_u)])
        cache_errs.append(e)
        if e > 1e-12:
            fails.append(f"cached ({len(cuts) - 1} chunks) vs uncached max rel {e} (f64)")
    print(f"{os.path.basename(case_dir):14s} rope={cfg.rope.rope_type:7s} inv_freq rel {rel:.1e}  cos/sin abs {rope_abs:.1e}  "
          f"recompute rel {worst:.1e}  cached-vs-uncached (f64) rel {max(cache_errs):.1e}  {'OK' if not fails else 'FAIL'}")
    return fails


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-fixtures", default=os.path.join(REPO, "draft-model", "tests", "fixtures"))
    args = ap.parse_args()
    bad = 0
    for name in sorted(os.listdir(args.draft_fixtures)):
        d = os.path.join(args.draft_fixtures, name)
        if not os.path.exists(os.path.join(d, "case.json")):
            continue
        for f in check_case(d):
            print(f"  FAIL {name}: {f}")
            bad += 1
    # YaRN inv_freq against the float32 transformers reference, at a published-size shape too
    big = O.parse_config({
        "hidden_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 1000, "block_size": 16,
        "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 9, 17, 25, 33]},
        "rope_theta": 1e7, "max_position_embeddings": 262144,
        "rope_scaling": {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
    })
    # transformers computes theta**(2i/dim) in float32: at theta 1e7 that alone is ~1.4e-7 relative
    rel, _ = O.check_inv_freq(big, rel_tol=3e-7)
    inv, af = O.inv_freq_f64(big.rope)
    print(f"yarn dim128 theta1e7 s64 L4096: inv_freq rel {rel:.1e}, attention_factor {af:.10f} (spec: 1.4158883083)")
    if abs(af - 1.4158883083) > 1e-9:
        bad += 1
    print("selfcheck:", "OK" if bad == 0 else f"{bad} failures")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

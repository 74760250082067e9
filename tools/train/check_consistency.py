#!/usr/bin/env python3
"""CPU check: the drafter's training forward (many anchors, masked) gives, for every anchor,
the same block rows as the inference forward (one block, context = taps at positions < anchor,
no mask), so what training optimises is what the speculative loop runs."""
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dflash_torch import DFlashDraft, default_target_layer_ids, draft_config  # noqa: E402
from pipeline import draft_batch  # noqa: E402

torch.manual_seed(0)
V, T = 300, 96
cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                  max_position_embeddings=512)
tgt = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
lids = default_target_layer_ids(6, 3)
dc = draft_config(cfg, 3, 16, 1, lids)
dr = DFlashDraft(dc).eval()
for p in dr.parameters():  # non-trivial norms
    p.data.add_(0.05 * torch.randn_like(p))
a = types.SimpleNamespace(block=16, d_anchors=7)
seqs = torch.randint(2, V, (3, T), dtype=torch.int16)
plens = torch.tensor([10, 40, 70], dtype=torch.int16)
x, blk, lab, q_pos, ctx_pos, mask = draft_batch(seqs, plens, torch.arange(3), a, torch.device("cpu"), 1)
with torch.no_grad():
    hs = tgt.model(input_ids=x, output_hidden_states=True).hidden_states
    taps = torch.cat([hs[l + 1] for l in lids], -1)
    z = dr(tgt.get_input_embeddings()(blk), taps, q_pos, ctx_pos, mask)
    worst = 0.0
    for bi in range(3):
        for n in range(a.d_anchors):
            anc = int(q_pos[bi, n * 16])
            assert anc >= int(plens[bi])
            rows = slice(n * 16, n * 16 + 16)
            zi = dr(tgt.get_input_embeddings()(blk[bi:bi + 1, rows]), taps[bi:bi + 1, :anc],
                    q_pos[bi:bi + 1, rows], ctx_pos[bi:bi + 1, :anc], None)
            err = (zi[0] - z[bi, rows]).abs().max().item() / z[bi, rows].abs().max().item()
            worst = max(worst, err)
            # labels: row k = token at anchor + k, row 0 masked
            for k in range(1, 16):
                exp = int(x[bi, anc + k]) if anc + k < T else -100
                assert int(lab[bi, n * 16 + k]) == exp
            assert int(lab[bi, n * 16]) == -100 and int(blk[bi, n * 16]) == int(x[bi, anc])
            assert (blk[bi, n * 16 + 1: n * 16 + 16] == 1).all()
print(f"train/inference block rows max rel diff {worst:.2e}")
assert worst < 1e-4, worst
print("OK")

# Speculative loop: with proposals = true greedy tokens corrupted at random, the committed
# stream equals plain greedy and each round's a is the index of the first corruption.
from dflash_torch import plain_greedy, spec_greedy  # noqa: E402

tgt.float()
prompt = [int(t) for t in torch.randint(2, V, (12,))]
ref = plain_greedy(tgt, prompt, 120, eos_id=-1)  # no stop token
rng = torch.Generator().manual_seed(1)
expected = []


def propose(out, s):
    # out[s] is the anchor at absolute position s; true continuation starts at s+1
    P = len(prompt)
    true = (ref + [0] * 40)[s + 1 - P: s + 16 - P]
    cut = int(torch.randint(0, 16, (1,), generator=rng))
    d = list(true)
    if cut < 15:
        d[cut] = (d[cut] + 1) % V
    expected.append(cut + 1)
    return d


gen, lens = spec_greedy(tgt, dr, prompt, 120, -1, propose=propose)
assert gen == ref[:120], "spec stream differs from plain greedy"
# the last round runs past max_new, where the padded proposals are not the true tokens
assert lens[:-1] == expected[: len(lens) - 1] and lens[-1] <= expected[len(lens) - 1], (lens, expected)
print(f"spec loop: {len(lens)} rounds, tau {sum(lens)/len(lens):.2f}, stream == greedy: OK")

"""The oracle's own greedy speculative loop (semantics sec. 3.3, with the round engine's verify-width policy).

    python tools/oracle/spec_loop.py --target DIR --draft DIR --prompt-ids 1,2,3 [--prompt-ids ...]
        [--prompts-file FILE (one comma/space separated id list per line)] [--prompts-jsonl FILE] [--first N]
        [--max-new 64]
        [--vt-cap 16] [--adaptive] [--no-markov] [--precision f32|bf16|q8_0|q4_0|mixed] [--eos ID,...] [--json]

Per round: block = [last, MASK x (b-1)] at positions s..s+b-1; cached draft forward (context = every committed
position < s); drafts = argmax of the draft rows (DFlash rows 1..b-1, anchor layout rows 0..b-1), through the
Markov chain when the drafter has one; the target verifies [last, d_1..d_{vt-1}] (vt rows); m = longest prefix of
drafts equal to the target's argmax; commit last + d_1..d_m (m + 1 tokens); next last = target argmax at row m;
the taps of the m + 1 kept rows go into the draft cache. vt = cap (default: the block size; at most the number of
drafts + 1), or with --adaptive vt = clamp(m + 2, 3, cap) after each round, starting at cap (rounded up to a
multiple of --vt-multiple, never past the cap).
max_new counts every generated token, the first (the argmax after the prompt) included; output is exactly max_new
tokens unless an EOS id comes first. With --engine-budget the loop follows the Rust round engine's budget rule
(vt = min(vt, tokens left); a last single token is emitted without a round), so rounds and tau compare exactly.

Stats per prompt: rounds, drafted (sum of vt - 1), accepted (sum of m), tau = (accepted + rounds) / rounds (mean
committed per round, counted before the max_new cut); pooled tau = sum over prompts of (accepted + rounds) / sum
of rounds; also the mean of per-prompt tau. The committed stream is checked against the target's plain greedy
decode computed with the same forward (exit status 1 on any difference).

Dense targets run with transformers' DynamicCache, cropped to the committed length after each verify (plain greedy
uses the same cache, one token per step); hybrid targets (linear-attention state cannot be cropped) and --no-cache
recompute the whole sequence on every call. Targets are loaded with transformers' AutoModelForCausalLM in float32,
eager attention.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_oracle as O  # noqa: E402


class HFTarget:
    def __init__(self, path: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(path)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        except ValueError:
            from transformers import AutoModelForImageTextToText

            self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32,
                                                                     attn_implementation="eager")
        self.model.eval()
        tc = getattr(cfg, "text_config", cfg)
        self.n_layers = tc.num_hidden_layers
        self.embed = self.model.get_input_embeddings().weight.detach().float()
        self.lm_head = self.model.get_output_embeddings().weight.detach().float()
        self.calls = 0

        lt = getattr(tc, "layer_types", None) or []
        # a KV cache that can be cropped: dense attention only (linear-attention state cannot be cropped)
        self.croppable = not any(t not in ("full_attention", "sliding_attention") for t in lt)
        self.use_cache = self.croppable
        self.calls = 0

    def _run(self, ids: list[int], cache):
        self.calls += 1
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True,
                             use_cache=cache is not None, past_key_values=cache)
        return out.logits[0].float(), [h[0].float() for h in out.hidden_states]

    def start(self, prompt: list[int]):
        """Begin a sequence; returns (logits, hidden_states) of the prompt rows."""
        self.seq = list(prompt)
        if self.use_cache:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=self.model.config)
            return self._run(prompt, self.cache)
        return self._run(self.seq, None)

    def extend(self, tokens: list[int]):
        """Append tokens; returns (logits, hidden_states) of the new rows only."""
        n = len(tokens)
        self.seq += tokens
        if self.use_cache:
            return self._run(tokens, self.cache)
        logits, hs = self._run(self.seq, None)
        return logits[-n:], [h[-n:] for h in hs]

    def truncate(self, n: int):
        """Keep the first n positions."""
        self.seq = self.seq[:n]
        if self.use_cache:
            drop = self.cache.get_seq_length() - n
            if drop > 0:
                self.cache.crop(-drop)

    def taps(self, hs, layer_ids, rows: slice):
        return torch.cat([hs[l + 1][rows] for l in layer_ids], dim=-1)


def plain_greedy(target: HFTarget, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    logits, _ = target.start(prompt)
    out = []
    while True:
        t = int(torch.argmax(logits[-1]))
        out.append(t)
        if t in eos or len(out) >= max_new:
            return out
        logits, _ = target.extend([t])


def spec_generate(target: HFTarget, cfg: O.DraftConfig, W: O.DraftWeights, prompt: list[int], max_new: int,
                  vt_cap: int, adaptive: bool, use_markov: bool, eos: set[int], engine_budget: bool = False,
                  vt_multiple: int = 1):
    ids = cfg.target_layer_ids
    for l in ids:
        if not -1 <= l <= target.n_layers - 2:
            raise ValueError(f"tap layer {l} invalid for a {target.n_layers}-layer target")
    logits, hs = target.start(prompt)
    cache = O.DraftCache(W)
    cache.ingest(target.taps(hs, ids, slice(0, len(prompt))), 0)
    last = int(torch.argmax(logits[-1]))
    seq = list(prompt)  # committed tokens (the pending `last` is not in it yet)
    out: list[int] = []
    vt = vt_cap
    rounds = drafted = accepted = 0
    first_draft = None
    per_round = []
    while len(out) < max_new:
        s = len(seq)
        assert len(cache) == s
        vt_round = vt
        if engine_budget:
            # the round engine's budget rule: never verify past max_new; the last token, already
            # known, is emitted without a forward (not a round)
            left = max_new - len(out)
            if left == 1:
                out.append(last)
                break
            vt_round = min(vt, left)
        drafts = O.propose(W, cache, last, s, target.embed, target.lm_head, use_markov=use_markov).tolist()
        if first_draft is None:
            first_draft = drafts
        block = [last] + drafts[: vt_round - 1]
        assert len(target.seq) == s
        vlogits, vhs = target.extend(block)
        am = torch.argmax(vlogits, dim=-1).tolist()  # am[j] = target's token after block[0..j]
        m = 0
        while m < len(block) - 1 and block[m + 1] == am[m]:
            m += 1
        rounds += 1
        drafted += len(block) - 1
        accepted += m
        per_round.append(m + 1)
        stop = False
        for t in block[: m + 1]:
            out.append(t)
            if t in eos or len(out) >= max_new:
                stop = True
                break
        if stop:
            break
        seq.extend(block[: m + 1])
        target.truncate(s + m + 1)  # keep anchor + accepted drafts; the next anchor is not in the target yet
        cache.ingest(target.taps(vhs, ids, slice(0, m + 1)), s)
        last = am[m]
        if adaptive:
            vt = min(-(-max(m + 2, 3) // vt_multiple) * vt_multiple, vt_cap)  # as the engine: the cap wins
    return out, {"rounds": rounds, "drafted": drafted, "accepted": accepted,
                 "tau": (accepted + rounds) / rounds if rounds else 0.0, "first_draft": first_draft,
                 "committed_per_round": per_round}


def selftest(target: HFTarget, cfg: O.DraftConfig, W: O.DraftWeights, prompt: list[int], max_new: int) -> bool:
    """Exercise the accept/commit/ingest path with oracle drafters built from the plain greedy stream: a perfect
    drafter (every round commits cap tokens) and ones wrong at draft j (every round commits j tokens)."""
    plain = plain_greedy(target, prompt, max_new + 40, set())
    full = list(prompt) + plain
    real = O.propose
    ok = True
    nd = cfg.block_size - 1 if cfg.layout == "dflash" else cfg.block_size
    try:
        for wrong_at in (None, 1, 3):
            def fake(W_, cache, anchor, start, *a, **k):
                assert full[start] == anchor, "anchor is not the committed greedy token"
                d = full[start + 1: start + 1 + nd]
                if wrong_at is not None:
                    d = list(d)
                    d[wrong_at - 1] = (d[wrong_at - 1] + 1) % cfg.vocab
                return torch.tensor(d)

            O.propose = fake
            for cap, adaptive in ((min(cfg.block_size, nd + 1), False), (5, True)):
                toks, st = spec_generate(target, cfg, W, prompt, max_new, cap, adaptive, True, set())
                per = wrong_at if wrong_at is not None else cap
                exp_rounds = -(-max_new // per) if not adaptive or wrong_at is not None else None
                good = toks == plain[:max_new] and (exp_rounds is None or st["rounds"] == exp_rounds)
                print(f"selftest wrong_at={wrong_at} cap={cap} adaptive={adaptive}: rounds {st['rounds']} "
                      f"tau {st['tau']:.3f} identical {toks == plain[:max_new]} {'OK' if good else 'FAIL'}")
                ok &= good
    finally:
        O.propose = real
    return ok


def parse_ids(s: str) -> list[int]:
    return [int(x) for x in s.replace(",", " ").split()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompt-ids", action="append", default=[])
    ap.add_argument("--prompts-file")
    ap.add_argument("--prompts-jsonl", help="JSON lines with an `ids` list (e.g. models/prompts-heldout.jsonl)")
    ap.add_argument("--first", type=int, default=0, help="use only the first N prompts (0: all)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--vt-cap", type=int, default=0, help="verify width cap (default: block size)")
    ap.add_argument("--adaptive", action="store_true", help="vt = clamp(m + 2, 3, cap) after each round")
    ap.add_argument("--no-markov", action="store_true")
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16", "q8_0", "q4_0", "mixed"])
    ap.add_argument("--layout", choices=["dflash", "anchor"])
    ap.add_argument("--eos", default="")
    ap.add_argument("--no-check", action="store_true", help="skip the plain greedy comparison")
    ap.add_argument("--vt-multiple", type=int, default=1,
                    help="with --adaptive, round vt up to a multiple of this (never past the cap), as the "
                         "engine's SpecConfig::verify_multiple")
    ap.add_argument("--engine-budget", action="store_true",
                    help="the Rust round engine's budget rule: vt = min(vt, tokens left); the last token "
                         "is emitted without a round (rounds/tau then match the engine's exactly)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-cache", action="store_true",
                    help="recompute the whole sequence every call (default for hybrid targets; dense targets "
                    "use a KV cache cropped after each verify)")
    ap.add_argument("--selftest", action="store_true", help="check the loop itself with oracle drafters")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    prompts = [parse_ids(p) for p in args.prompt_ids]
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [parse_ids(line) for line in f if line.strip()]
    if args.prompts_jsonl:
        with open(args.prompts_jsonl) as f:
            prompts += [list(map(int, json.loads(line)["ids"])) for line in f if line.strip()]
    if args.first:
        prompts = prompts[: args.first]
    if not prompts:
        ap.error("no prompts")
    eos = set(parse_ids(args.eos)) if args.eos else set()
    target = HFTarget(args.target)
    target.use_cache = target.croppable and not args.no_cache
    prec = "f32" if args.precision == "bf16" else args.precision  # bf16 weights upcast: same values
    cfg, W = O.load_draft(args.draft, precision=prec, layout=args.layout)
    nd = cfg.block_size - 1 if cfg.layout == "dflash" else cfg.block_size
    cap = args.vt_cap or cfg.block_size
    cap = max(2, min(cap, nd + 1))

    if args.selftest:
        sys.exit(0 if selftest(target, cfg, W, prompts[0], args.max_new) else 1)

    results = []
    ok = True
    t0 = time.time()
    for i, p in enumerate(prompts):
        toks, st = spec_generate(target, cfg, W, p, args.max_new, cap, args.adaptive, not args.no_markov, eos,
                                 args.engine_budget, max(1, args.vt_multiple))
        r = {"prompt": i, "prompt_len": len(p), "tokens": toks, **st}
        if not args.no_check:
            plain = plain_greedy(target, p, args.max_new, eos)
            r["plain_tokens"] = plain
            r["identical"] = plain == toks
            ok &= r["identical"]
        results.append(r)
    R = sum(r["rounds"] for r in results)
    A = sum(r["accepted"] for r in results)
    summary = {
        "target": args.target, "draft": args.draft, "layout": cfg.layout, "block_size": cfg.block_size,
        "vt_cap": cap, "adaptive": args.adaptive, "markov": (not args.no_markov) and cfg.markov_rank > 0,
        "max_new": args.max_new, "prompts": len(prompts), "rounds": R, "accepted": A,
        "drafted": sum(r["drafted"] for r in results),
        "tau_pooled": (A + R) / R if R else 0.0,
        "tau_mean_per_prompt": sum(r["tau"] for r in results) / len(results),
        "identical": ok if not args.no_check else None, "seconds": time.time() - t0,
        "per_prompt": results,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for r in results:
            same = "" if args.no_check else f"  identical={r['identical']}"
            print(f"prompt {r['prompt']:3d}: len {r['prompt_len']:4d}  rounds {r['rounds']:4d}  accepted {r['accepted']:5d}"
                  f"  tau {r['tau']:.3f}{same}")
        print(f"pooled tau {summary['tau_pooled']:.3f}  mean per-prompt tau {summary['tau_mean_per_prompt']:.3f}  "
              f"rounds {R}  accepted {A}  vt_cap {cap}{' adaptive' if args.adaptive else ''}"
              f"{'' if args.no_check else '  all identical: ' + str(ok)}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

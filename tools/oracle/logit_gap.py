"""Top-2 logits of the target's next-token distribution after an id sequence (float32, eager, no cache).

    python tools/oracle/logit_gap.py --target DIR --ids 1,2,3 [--tokens 5,7] [--json]

Prints the two largest logits (id and value), their gap, and the logits of --tokens (for instance the tokens two
implementations chose at a position where their greedy streams part): a gap of a few 1e-6 relative to the logits
is an f32 near-tie, where a different summation order may pick the other token."""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_loop import HFTarget, parse_ids  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--tokens", default="")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    t = HFTarget(a.target)
    logits, _ = t.start(parse_ids(a.ids))
    last = logits[-1]
    v, i = torch.topk(last, 2)
    r = {"top": [[int(i[0]), float(v[0])], [int(i[1]), float(v[1])]], "gap": float(v[0] - v[1]),
         "tokens": {str(x): float(last[x]) for x in (parse_ids(a.tokens) if a.tokens else [])}}
    print(json.dumps(r) if a.json else r)


if __name__ == "__main__":
    main()

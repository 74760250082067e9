#!/usr/bin/env python3
"""Read the per-block trace of `xtask bench gpu --trace FILE` (CudaOptions::block_trace).

Prints, per kernel launch of one step (in order of release), when its blocks became resident
and reached the dependency wait ("at wait"), when the wait returned ("released": the kernel
before it had finished), when the Q8_0A8 matmul blocks' main loops ended ("loop end"), and how
many blocks arrived only after the release ("late": they found no room while the kernel before
ran). Times in us from the step's first record. Then, per matmul launch, the loop ends'
quantiles and each SM's last loop end by the SM's block count (an SM with more blocks than
others ends later: the 27B paired gate / up before its queue launch, twenty-eighth session).
A queue launch's pieces (matmul.cu A8KPQ) re-enter the split kernel's prologue, so they show as
a second launch of the same blocks.

    python3 tools/bench/block_trace.py trace.csv [--shape 8B] [--ctx 512]

Launches are told apart by the record's kernel (module and source line) and block index: a
block index seen again starts the next launch of that kernel. Loop ends are matched to the
launch of the same module and block count that was released last before them.
"""

import argparse
import bisect
import csv
import collections
import os
import re
import statistics


def kernel_names(root):
    """(module, line) -> the function that line is in, from the kernel sources."""
    names = {}
    for module in ("matmul", "attention", "elementwise", "reduce"):
        path = os.path.join(root, "cuda-kernels", "kernels", module + ".cu")
        if not os.path.exists(path):
            continue
        current = "?"
        with open(path) as f:
            for i, line in enumerate(f, start=1):
                m = re.match(r"^(?:extern \"C\" )?(?:__global__|__device__|template)?.*?\b(\w+)\s*\(", line)
                if m and not line.startswith((" ", "\t", "#", "/", "}")):
                    current = m.group(1)
                names[(module, i)] = current
    return names


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--shape", default="", help="prefix of the shape name")
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    a = ap.parse_args()

    rows = []
    with open(a.csv) as f:
        for r in csv.DictReader(f):
            if not r["shape"].startswith(a.shape):
                continue
            if a.ctx is not None and int(r["ctx"]) != a.ctx:
                continue
            rows.append(r)
    if not rows:
        raise SystemExit("no records match")
    keys = sorted({(r["shape"], int(r["ctx"])) for r in rows})
    if len(keys) > 1:
        raise SystemExit(f"several steps in the file, pick one with --shape / --ctx: {keys}")
    for r in rows:
        for k in ("line", "sm", "t0_ns", "t1_ns", "block", "blocks"):
            r[k] = int(r[k])
    names = kernel_names(a.root)
    waits = [r for r in rows if r["kind"] == "wait"]
    ends = [r for r in rows if r["kind"] == "end"]
    t_start = min(r["t0_ns"] for r in waits)
    us = lambda t: (t - t_start) / 1e3

    by_kernel = collections.defaultdict(list)
    for r in waits:
        by_kernel[(r["module"], r["line"], r["blocks"])].append(r)
    launches = []
    for key, recs in by_kernel.items():
        recs.sort(key=lambda r: r["t1_ns"])
        cur, seen = [], set()
        for r in recs:
            if r["block"] in seen:
                launches.append((key, cur))
                cur, seen = [], set()
            cur.append(r)
            seen.add(r["block"])
        launches.append((key, cur))
    launches.sort(key=lambda x: min(r["t1_ns"] for r in x[1]))

    # Loop ends: to the last launch of the same (module, blocks) released before them.
    rel = collections.defaultdict(list)  # (module, blocks) -> [(release, launch index)]
    for i, ((module, _, blocks), recs) in enumerate(launches):
        rel[(module, blocks)].append((min(r["t1_ns"] for r in recs), i))
    end_of = collections.defaultdict(list)
    end_sm = collections.defaultdict(list)  # launch -> [(loop end, sm)]
    for r in ends:
        cand = rel.get((r["module"], r["blocks"]), [])
        j = bisect.bisect_right([c[0] for c in cand], r["t0_ns"]) - 1
        if j >= 0:
            end_of[cand[j][1]].append(r["t0_ns"])
            end_sm[cand[j][1]].append((r["t0_ns"], r["sm"]))

    print(f"{keys[0][0]} ctx {keys[0][1]}: {len(launches)} launches, {len(rows)} records\n")
    print("| # | kernel (module:line) | blocks | at wait: first / median | released: first / last | late | loop end: median / last | from release to last end |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for i, ((module, line, blocks), recs) in enumerate(launches):
        t0 = [us(r["t0_ns"]) for r in recs]
        t1 = [us(r["t1_ns"]) for r in recs]
        late = sum(1 for r in recs if r["t1_ns"] - r["t0_ns"] < 300)
        e = [us(t) for t in end_of.get(i, [])]
        e_txt = f"{statistics.median(e):.2f} / {max(e):.2f}" if e else ""
        span = f"{max(e) - min(t1):.2f}" if e else ""
        name = names.get((module, line), "?")
        print(
            f"| {i} | {name} ({module}:{line}) | {blocks} | {min(t0):.2f} / {statistics.median(t0):.2f} "
            f"| {min(t1):.2f} / {max(t1):.2f} | {late} | {e_txt} | {span} |"
        )
    # End spread per SM for the matmuls with more than one block per SM.
    print("\nMatmul loop ends per launch (us): quantiles, and the blocks per SM")
    for i, ((module, line, blocks), recs) in enumerate(launches):
        e = end_of.get(i, [])
        if not e:
            continue
        per_sm = collections.Counter(r["sm"] for r in recs)
        print(
            f"  #{i} {blocks} blocks: q10 {us(quantile(e, .1)):.2f}  q50 {us(quantile(e, .5)):.2f}  "
            f"q90 {us(quantile(e, .9)):.2f}  max {us(max(e)):.2f}  blocks per SM {dict(collections.Counter(per_sm.values()))}"
        )
        # Each SM's last loop end, by the SM's block count: do SMs with more blocks end later?
        last = {}
        for t, sm in end_sm[i]:
            last[sm] = max(last.get(sm, t), t)
        by_count = collections.defaultdict(list)
        for sm, t in last.items():
            by_count[per_sm[sm]].append(us(t))
        print(
            "      SMs' last loop end by blocks per SM: "
            + ", ".join(
                f"{k}: {statistics.median(v):.2f} (max {max(v):.2f}, {len(v)} SMs)" for k, v in sorted(by_count.items())
            )
        )


if __name__ == "__main__":
    main()

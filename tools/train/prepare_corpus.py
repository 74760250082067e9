#!/usr/bin/env python3
"""Build the training corpus, the tokenizer and the held-out prompt set (runs on the CPU).

Corpus: the Python standard library sources of one CPython installation (PSF licence),
one copy of each file (content-hash dedupe), third-party site-packages, generated
tables and test-data folders excluded. Split by file (hash-seeded) into train and
held-out. Tokenizer: byte-level BPE (the `tokenizers` package) with the special tokens
`<|endoftext|>` (EOS / document separator) and `<|MASK|>` (DFlash mask token).

Outputs (under --out):
  tokenizer.json, train.u16, heldout.u16 (token streams, documents separated by EOS),
  files.json (the file lists of both splits with their hashes), corpus_stats.json,
  prompts-heldout.jsonl ({"prompt", "ids", "file"} code prefixes from held-out files).
"""
import argparse
import hashlib
import json
import os
import random
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
MASK = "<|MASK|>"

# Folders (relative to the stdlib root) that hold third-party code, generated tables or
# test data rather than hand-written library code.
EXCLUDED_DIRS = {
    "site-packages",
    "pydoc_data",  # generated documentation text (topics.py)
    "encodings",  # mostly generated codec tables
    "__pycache__",
    "config-3.11-x86_64-linux-gnu",
}
EXCLUDED_DIR_PARTS = ("data", "badsyntax", "encoded_modules", "crashers", "leakers")


def collect(root):
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if parts and parts[0] in EXCLUDED_DIRS:
            dirnames[:] = []
            continue
        if any(any(x in p for x in EXCLUDED_DIR_PARTS) for p in parts):
            continue
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(".py") and "badsyntax" not in fn and "bad_coding" not in fn:
                files.append(os.path.join(dirpath, fn))
    return files


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/root/.pyenv/versions/3.11.7/lib/python3.11")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heldout-frac", type=float, default=0.03)
    ap.add_argument("--max-file-bytes", type=int, default=400_000)
    ap.add_argument("--n-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--limit-files", type=int, default=0, help="dry runs: keep only N files")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    paths = collect(args.root)
    seen = {}
    docs = []  # (relpath, sha256, text)
    n_dup = n_undecodable = n_big = n_empty = 0
    for p in paths:
        raw = open(p, "rb").read()
        if len(raw) > args.max_file_bytes:
            n_big += 1
            continue
        if len(raw.strip()) == 0:
            n_empty += 1
            continue
        h = hashlib.sha256(raw).hexdigest()
        if h in seen:
            n_dup += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            n_undecodable += 1
            continue
        seen[h] = p
        docs.append((os.path.relpath(p, args.root), h, text.replace("\r\n", "\n")))
    if args.limit_files:
        docs = docs[: args.limit_files]
    # Split by file: a file is held out iff its hash (seeded) falls in the lowest fraction.
    rng = random.Random(args.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_held = max(2, int(round(args.heldout_frac * len(docs))))
    held_idx = set(order[:n_held])
    train_docs = [d for i, d in enumerate(docs) if i not in held_idx]
    held_docs = [d for i, d in enumerate(docs) if i in held_idx]
    print(f"files found {len(paths)}; kept {len(docs)} (dup {n_dup}, too big {n_big}, "
          f"empty {n_empty}, not utf-8 {n_undecodable}); train {len(train_docs)}, held-out {len(held_docs)}",
          flush=True)

    # Tokenizer: trained on the train split only.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        min_frequency=2,
        special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d[2] for d in train_docs), trainer=trainer, length=len(train_docs))
    tok.save(os.path.join(args.out, "tokenizer.json"))
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)
    vocab = tok.get_vocab_size()
    print(f"tokenizer: vocab {vocab}, eos {eos_id}, mask {mask_id}", flush=True)

    def stream(ds):
        enc = tok.encode_batch([d[2] for d in ds], add_special_tokens=False)
        out = []
        for e in enc:
            out.extend(e.ids)
            out.append(eos_id)
        return np.asarray(out, dtype=np.uint16), enc

    train_ids, _ = stream(train_docs)
    held_ids, held_enc = stream(held_docs)
    train_ids.tofile(os.path.join(args.out, "train.u16"))
    held_ids.tofile(os.path.join(args.out, "heldout.u16"))
    n_bytes_train = sum(len(d[2].encode()) for d in train_docs)
    print(f"tokens: train {len(train_ids)}, held-out {len(held_ids)}; "
          f"{n_bytes_train / max(1, len(train_ids)):.2f} bytes/token", flush=True)

    # Held-out prompts: line-aligned code prefixes of 64..200 tokens from held-out files.
    prng = random.Random(args.seed + 1)
    prompts = []
    cands = [d for d in held_docs if len(d[2]) > 2000]
    prng.shuffle(cands)
    per_file = max(1, -(-args.n_prompts // max(1, len(cands))))
    for rel, h, text in cands:
        lines = text.split("\n")
        made = 0
        for _ in range(20):
            if made >= per_file or len(prompts) >= args.n_prompts:
                break
            start = prng.randrange(0, max(1, len(lines) - 10))
            want = prng.randint(64, 200)
            buf = ""
            for ln in lines[start:]:
                cand = buf + ln + "\n"
                if len(tok.encode(cand, add_special_tokens=False).ids) > want:
                    break
                buf = cand
            ids = tok.encode(buf, add_special_tokens=False).ids
            if len(ids) < 64 or not buf.strip():
                continue
            assert tok.decode(ids, skip_special_tokens=False) == buf
            prompts.append({"prompt": buf, "ids": ids, "file": rel})
            made += 1
        if len(prompts) >= args.n_prompts:
            break
    with open(os.path.join(args.out, "prompts-heldout.jsonl"), "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    print(f"held-out prompts: {len(prompts)}", flush=True)

    json.dump({"train": [[d[0], d[1]] for d in train_docs], "heldout": [[d[0], d[1]] for d in held_docs]},
              open(os.path.join(args.out, "files.json"), "w"), indent=0)
    stats = {
        "root": args.root, "python": "3.11.7", "files_found": len(paths), "files_kept": len(docs),
        "duplicates_dropped": n_dup, "too_big_dropped": n_big, "empty_dropped": n_empty,
        "not_utf8_dropped": n_undecodable, "train_files": len(train_docs), "heldout_files": len(held_docs),
        "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
        "train_bytes": n_bytes_train, "vocab_size": vocab, "eos_id": eos_id, "mask_id": mask_id,
        "seed": args.seed, "heldout_prompts": len(prompts), "excluded_dirs": sorted(EXCLUDED_DIRS),
        "excluded_dir_parts": list(EXCLUDED_DIR_PARTS), "max_file_bytes": args.max_file_bytes,
    }
    json.dump(stats, open(os.path.join(args.out, "corpus_stats.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

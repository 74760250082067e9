#!/bin/bash
# Continue training the shipped drafter on the GPU machine (run from the repository root, with
# the corpus of prepare_corpus.py in DATA): split the shipped target into the run folder the way
# pipeline.py expects it, regenerate target-made continuations, train from
# models/draft/model.safetensors, and leave draft.safetensors + metrics.json + log.txt in OUT.
# Usage: continue_draft.sh DATA OUT SEED LR BUDGET_S
set -euo pipefail
DATA=${1:?corpus folder}; OUT=${2:?output folder}; SEED=${3:-20261129}; LR=${4:-4e-4}; BUDGET=${5:-230}
RUN=$(mktemp -d)
python3 - "$RUN" <<'PY'
import sys
from safetensors.torch import load_file, save_file
sd = load_file("models/target/model.safetensors")
keys = sorted(sd); half = len(keys) // 2
save_file({k: sd[k] for k in keys[:half]}, f"{sys.argv[1]}/target_a.safetensors", metadata={"format": "pt"})
save_file({k: sd[k] for k in keys[half:]}, f"{sys.argv[1]}/target_b.safetensors", metadata={"format": "pt"})
PY
mkdir -p "$OUT"
python3 tools/train/pipeline.py --data "$DATA" --out "$RUN" --stages gen,draft --seed "$SEED" \
  --g-tokens 20000000 --g-budget 75 --d-batch 128 --d-lr "$LR" --d-budget "$BUDGET" --d-eval-every 500 \
  --d-init models/draft/model.safetensors 2>&1 | tee "$OUT/log.txt"
cp "$RUN/draft.safetensors" "$RUN/metrics.json" "$OUT/"

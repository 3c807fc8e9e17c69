#!/usr/bin/env bash
# Two trees on one GPU machine, one after the other, in the order old, new, new, old (so drift shows as a
# spread, not as a difference): W1, batch-1 and TTFT at 128 tokens from benchmarks/gpu_w1.py, with its
# per-step host timings.
#
#   git archive COMMIT | tar -x -C .old      # here: the older tree, in a folder git ignores (carry it)
#   bash benchmarks/gpu_tree_ab.sh .old      # there; results in $OUT/{old,new}{1,2}/gpu_w1.json
#   RUNS="old1 new1" bash benchmarks/gpu_tree_ab.sh .old   # fewer runs (each is one engine start and W1 twice)
set -uo pipefail
old=${1:?usage: $0 OLD_TREE_DIR}
out=${OUT:-/tmp/tree_ab}
here=$PWD
for run in ${RUNS:-old1 new1 new2 old2}; do
  case $run in old*) tree=$old ;; *) tree=$here ;; esac
  mkdir -p "$out/$run"
  echo "=== $run ($tree)"
  (cd "$tree" && PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 python3 benchmarks/gpu_w1.py --skip-hf --skip-parity \
      --out "$out/$run") 2>&1 | grep -E "^\||host|step|tok/s|TTFT|Error|error" | tail -30
done
python3 - "$out" <<'PY'
import json, sys, os
rows = []
for run in os.environ.get("RUNS", "old1 new1 new2 old2").split():
    f = os.path.join(sys.argv[1], run, "gpu_w1.json")
    if not os.path.exists(f):
        print(run, "no results"); continue
    r = json.load(open(f))
    flat = {k: v for k, v in r.items() if isinstance(v, (int, float))}
    for k, v in r.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{a}": b for a, b in v.items() if isinstance(b, (int, float))})
    rows.append((run, flat))
keys = sorted({k for _, f in rows for k in f if any(w in k for w in ("tok_s", "ttft", "per_step", "host", "seconds"))})
print("| measure | " + " | ".join(r for r, _ in rows) + " |")
for k in keys:
    print(f"| {k} | " + " | ".join(f"{f.get(k, float('nan')):.4g}" for _, f in rows) + " |")
PY

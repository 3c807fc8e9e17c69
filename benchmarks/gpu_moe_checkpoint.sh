#!/usr/bin/env bash
# Qwen3-30B-A3B fp8, kvserve against vLLM 0.26.0 on the same random fp8 checkpoint (so both route alike), in one
# device call after the vLLM bundle's pieces are on the machine (.vllm/README.md: p0 and m0 first, then this call
# carrying p1 and the bundle's scripts):
#
#     bash .vllm/install.sh && bash benchmarks/gpu_moe_checkpoint.sh
#
# 1. benchmarks/write_random_checkpoint.py writes the checkpoint to $CKPT (~31 GB; skipped when it is there).
# 2. vLLM's W1 and batch-1 on it (the bundle's vllm_bench.py), then kvserve's (benchmarks/gpu_moe.py --checkpoint),
#    whose table prints the ratio. Each step has its own time limit, so one slow start cannot take the call.
# 3. With PROFILE=1 only (the checkpoint written or found as in 1.), where each engine's W1 decode step goes instead:
#    benchmarks/profile_moe_steps.py for vLLM, then kvserve, then their side-by-side table (JSON in /tmp/vres too).
# 4. With SPREAD=1 only (a second call on the same warm machine: the checkpoint stays in /tmp), both engines'
#    routing spread on it instead (benchmarks/moe_routing_spread.py --checkpoint, eager, 64 requests).
# ENGINES=vllm or ENGINES=kvserve runs one engine's part only (two calls on one warm machine when one call's time
# limit cannot hold both; kvserve's part reads vLLM's result from /tmp/vres); PASSES=2 times W1 twice on each engine.
# Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/moe_checkpoint_out}"
CKPT="${CKPT:-/tmp/qwen3-moe-fp8}"
mkdir -p "$OUT" /tmp/vres

[ -f "$CKPT/config.json" ] || timeout 240 python3 benchmarks/write_random_checkpoint.py --shape qwen3-30b-a3b \
    --fp8 --out "$CKPT" || { echo "writing the checkpoint failed"; exit 1; }
df -h /tmp | tail -1
if [ "${SPREAD:-0}" = 1 ]; then
  OUT="$OUT" timeout 240 python3 benchmarks/moe_routing_spread.py --engine vllm --checkpoint "$CKPT" 2>&1 | tail -1
  OUT="$OUT" timeout 150 python3 benchmarks/moe_routing_spread.py --engine kvserve --checkpoint "$CKPT" 2>&1 | tail -1
  exit 0
fi
ENGINES="${ENGINES:-both}"
PASSES="${PASSES:-1}"  # timed W1 passes of each engine (the best is the row; all of them show the spread)
if [ "${PROFILE:-0}" = 1 ]; then
  for engine in vllm kvserve; do
    [ "$ENGINES" = both ] || [ "$ENGINES" = "$engine" ] || continue
    OUT=/tmp/vres timeout 330 python3 benchmarks/profile_moe_steps.py --engine "$engine" --checkpoint "$CKPT" \
        > "$OUT/profile_$engine.log" 2>&1
    echo "profile $engine rc $?"; tail -2 "$OUT/profile_$engine.log"
  done
  cp /tmp/vres/moe_steps_*.json "$OUT/" 2>/dev/null
  python3 benchmarks/profile_moe_steps.py --table /tmp/vres
  exit 0
fi
if [ "$ENGINES" != kvserve ]; then
OUT=/tmp/vres timeout 330 python3 .vllm/vllm_bench.py --shape qwen3-30b-a3b --tag _moe_checkpoint --passes "$PASSES" \
    --extra "{\"model\": \"$CKPT\", \"load_format\": \"auto\"}" > "$OUT/vllm_checkpoint.log" 2>&1
echo "vllm rc $?"; cp /tmp/vres/vllm_bench_moe_checkpoint.json "$OUT/" 2>/dev/null
tail -5 "$OUT/vllm_checkpoint.log"
fi
[ "$ENGINES" = vllm ] && exit 0
# MOE_ARGS: more benchmarks/gpu_moe.py arguments, e.g. its variants ("--tiles-from FILE", each one more run);
# KVSERVE_LIMIT_S: the time limit of kvserve's part (about 150 s a run).
timeout "${KVSERVE_LIMIT_S:-200}" python3 benchmarks/gpu_moe.py --checkpoint "$CKPT" --configs "" --skip-parity \
    --skip-kernel --vllm-dir /tmp/vres --out "$OUT" --passes "$PASSES" ${MOE_ARGS:-} 2>&1 | tail -24

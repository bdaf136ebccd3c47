#!/usr/bin/env bash
# The GPU check: one call on one GPU, under 10 minutes, from the source tree (no install:
# PYTHONPATH; every optional package is imported lazily, where a feature needs it).
#
#   OUT=DIR [PARTS="sweep mfu"] bash benchmarks/gpu/check.sh [--dry-run]
#
# PARTS: run only these parts (a rerun of what failed); all of them by default.
# Parts, in this order, each a process of its own under `timeout` (the limits below, cut to
# what is left of BUDGET_S so that the report is always written):
#   probe        versions, device, collectives, the kernels torch offers, free memory
#   collectives  a one-rank NCCL group through every backend call the runtime makes
#   tests        python -m pytest tests/gpu (default-model numbers, CLI async save and
#                resume, context-parallel kernels in bf16 and fp32, MoE grouped matmul,
#                profiler trace and memory snapshot, compiled step)
#   sweep        the tiny preset's features: 8 steps, eval, sample, save and resume each
#   audit        profiler audit of the default model's step in bf16 and fp32
#   dryrun       --dry-run-world 8 of Llama 3 8B: the allocator against the planner
#   mfu          a 1B Llama's step, shardtrain (bf16, compiled) against transformers
# Everything goes to $OUT/log; report.py writes $OUT/check.json and $OUT/check.md (one
# table) and the exit status (0: every part exited 0 and every row is ok).
#
# --dry-run: the same script on the CPU, each part replaced by its CPU twin (tiny sizes),
# as tests/test_gpu_check.py runs it. docs/performance.md: how to run it through the
# device tool in one call.
set -u -o pipefail

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: OUT=DIR bash benchmarks/gpu/check.sh [--dry-run]" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$ROOT/gpu-check}
BUDGET_S=${BUDGET_S:-585}  # the device tool's limit for one command is 600 s
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR="$WORK/inductor"
PY=${PYTHON:-python3}
DEVICE=cuda
[ "$DRY" = 1 ] && DEVICE=cpu
ROWS=(--device "$DEVICE" --rows "$WORK/rows.jsonl")
CACHE=(--cache "$WORK/tokens")  # one token cache for the parts that train
T0=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...: run it under timeout, record its exit and seconds
  local name=$1 limit=$2 start rc left
  shift 2
  left=$(( BUDGET_S - ($(date +%s) - T0) - 10 ))  # 10 s kept for the report
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  start=$(date +%s)
  if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then
    echo "=== $name: not in PARTS"
    return
  fi
  if [ "$limit" -lt 5 ]; then
    echo "=== $name: not run, the budget of ${BUDGET_S} s is spent"
    rc=125
  else
    echo "=== $name (limit ${limit} s): $*"
    timeout -k 5 "$limit" "$@"
    rc=$?
  fi
  echo "{\"part\": \"$name\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - start ))," \
       "\"limit\": $limit}" >> "$WORK/parts.jsonl"
  echo "=== $name: exit $rc after $(( $(date +%s) - start )) s"
}

main() {
  cd "$ROOT" || exit 2
  echo "{\"when\": \"$(date -u +%FT%TZ)\", \"dry_run\": $([ "$DRY" = 1 ] && echo true || echo false)}" \
    > "$WORK/meta.json"
  part probe 30 "$PY" benchmarks/gpu/probe.py "${ROWS[@]}"
  part collectives 25 "$PY" benchmarks/gpu/collectives.py "${ROWS[@]}"
  part tests 140 "$PY" -m pytest tests/gpu -q -s -p no:cacheprovider --device "$DEVICE" \
    -o junit_family=legacy \
    --junitxml "$WORK/tests.xml"
  part sweep 130 "$PY" benchmarks/gpu/sweep.py "${ROWS[@]}" "${CACHE[@]}"
  part audit 40 "$PY" benchmarks/gpu/audit.py "${ROWS[@]}" "${CACHE[@]}"
  part dryrun 85 "$PY" benchmarks/gpu/dryrun.py "${ROWS[@]}" "${CACHE[@]}"
  part mfu 125 "$PY" benchmarks/gpu/mfu.py "${ROWS[@]}" "${CACHE[@]}"
  echo "=== total $(( $(date +%s) - T0 )) s"
  "$PY" benchmarks/gpu/report.py "$WORK" "$OUT"
}

main 2>&1 | tee "$OUT/log"

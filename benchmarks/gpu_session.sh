#!/usr/bin/env bash
# One device call: record the GPU baselines (if asked), then GPU test stages in parallel
# processes (the GPU has room; the 16 host cores too). Logs under $OUT (at most 8 files
# come back: one .log a stage, record.log and baselines-cuda.tar).
#   bash benchmarks/gpu_session.sh [record] STAGE...   (stages of benchmarks/h200_run.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv
pids=()
if [ "${1:-}" = record ]; then
  shift
  ( timeout -s INT 330 python3 -m tests.record_baselines --device cuda \
      --reason "${BASELINE_REASON:-GPU baselines recorded on an H200}" > "$OUT/record.log" 2>&1 \
    && timeout -s INT 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      tests/test_gpu_baselines.py >> "$OUT/record.log" 2>&1
    tar -cf "$OUT/baselines-cuda.tar" tests/baselines/*-cuda.json ) &
  pids+=($!)
fi
for stage in "$@"; do
  OUT=$OUT bash benchmarks/h200_run.sh "$stage" > /dev/null 2>&1 &  # writes $OUT/$stage.log
  pids+=($!)
done
wait "${pids[@]}"
tail -n 25 "$OUT"/*.log

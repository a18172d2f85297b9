#!/usr/bin/env bash
# One device call of timed stages, one after the other (no overlap: they time the GPU):
#   bash benchmarks/gpu_call.sh 'NAME SECONDS COMMAND...' ...
# Installs the carried wheels (.whl) first; each stage's output goes to $OUT/NAME.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for spec in "$@"; do
  read -r name limit cmd <<< "$spec"
  echo "== $name (limit ${limit}s): $cmd"
  start=$(date +%s)
  timeout -s INT "$limit" bash -c "$cmd" > "$OUT/$name.log" 2>&1
  echo "rc $? in $(( $(date +%s) - start )) s"
  tail -n 40 "$OUT/$name.log"
done

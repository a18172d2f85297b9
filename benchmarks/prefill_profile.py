"""Where a prompt step's GPU time goes: one prefill of the random Qwen3-8B-shaped 4-bit model
(benchmarks/bench_gpu.py) with every launcher of cuda_kernels/launch.py wrapped in CUDA events
(the stream synchronised after each, so the figures are GPU time a launcher, summed).

    python benchmarks/prefill_profile.py [--prompt 2048] [--layers 36]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
from bench_gpu import PAGE_SIZE, forward, make_batch, random_model


def wrap_launchers(cp, totals: dict[str, float]) -> None:
    from cuda_kernels import launch

    for name in ("matmul", "attention", "kv_write", "attn_inputs", "rms_norm", "rms_norm_quantize", "rope",
                 "silu_mul", "argmax", "embed_affine"):
        inner = getattr(launch, name)

        def timed(*args, _inner=inner, _name=name, **kw):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            _inner(*args, **kw)
            stop.record()
            stop.synchronize()
            totals[_name] += cp.cuda.get_elapsed_time(start, stop)

        setattr(launch, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=36)
    args = parser.parse_args()
    from tf_async.backend.cuda_ops import CudaOps
    from tf_async.engine.runner import Arena
    from tf_async.models.checkpoint import Checkpoint
    from tf_async.models.decoder import Decoder

    ops = CudaOps()
    cp = ops.xp
    cfg, weights = random_model(cp, args.layers)
    decoder = Decoder(Checkpoint(cfg, weights, None, "q4"), ops)  # type: ignore[arg-type]
    pages = -(-(args.prompt + 8) // PAGE_SIZE)
    arena = Arena(ops, decoder, num_pages=pages, page_size=PAGE_SIZE, kv_dtype="bf16")
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt).tolist()
    batch = make_batch(ops, [(0, 0, prompt)], pages, False)
    forward(decoder, arena, ops, batch)  # compiles
    ops.synchronize()
    t0 = time.perf_counter()
    forward(decoder, arena, ops, batch)
    ops.synchronize()
    wall = time.perf_counter() - t0
    totals: dict[str, float] = defaultdict(float)
    wrap_launchers(cp, totals)
    forward(decoder, arena, ops, batch)
    ops.synchronize()
    print(f"prompt {args.prompt}, {args.layers} layers: {wall * 1e3:.1f} ms unwrapped "
          f"({args.prompt / wall:.0f} tok/s)")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:18} {ms:9.2f} ms")
    print(f"  {'sum':18} {sum(totals.values()):9.2f} ms")


if __name__ == "__main__":
    main()

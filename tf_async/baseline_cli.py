"""`tf-async gate --record FILE` and `tf-async gate --against FILE` (tf_async/baseline.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from . import baseline
from .backend.select import resolve_device
from .engine.build import load_model
from .errors import BadInputError


def _record(args: argparse.Namespace) -> int:
    if args.tensor_parallel != 1:  # a baseline is the reference: TP runs are checked against it
        raise BadInputError("--record runs at --tensor-parallel 1; compare a TP run with "
                            "--against FILE --tensor-parallel N", param="tensor_parallel")
    ckpt = load_model(args.model)
    settings = baseline.BaselineSettings(device=resolve_device(args.device),
                                         kv_dtype=args.kv_dtype, max_tokens=args.max_tokens)
    doc = asyncio.run(baseline.record(ckpt, settings, reason=args.reason))
    baseline.write(doc, args.record)
    total = sum(len(s["requests"]) for s in doc["sections"].values())
    print(f"recorded {total} requests of {doc['model']['name']} on {settings.device} "
          f"to {args.record}")
    return 0


def _against(args: argparse.Namespace) -> int:
    doc = baseline.load(args.against)
    if args.tolerance is not None and args.tolerance < 0:
        raise BadInputError("--tolerance must be >= 0", param="tolerance")
    why = baseline.host_differs(doc)
    if why:
        print(f"warning: {why}; log-probs may differ in their last bits", file=sys.stderr)
    ckpt = load_model(args.model)
    results = asyncio.run(baseline.check(ckpt, doc, args.against, tolerance=args.tolerance,
                                         tensor_parallel=args.tensor_parallel))
    for result in results:
        print(f"{result.format():<44} {'PASS' if result.ok else 'FAIL'}")
        for mismatch in result.mismatches:
            print(f"    {mismatch}")
    return 0 if all(r.ok for r in results) else 1


def main_baseline(args: argparse.Namespace) -> int:
    if args.record and args.against:
        raise BadInputError("--record and --against are exclusive", param="record")
    t0 = time.perf_counter()
    code = _record(args) if args.record else _against(args)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return code

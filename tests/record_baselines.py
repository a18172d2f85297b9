"""Record the committed baselines (tests/baselines/): every tiny model of
tests/baseline_models.py on DEVICE, and on the CPU the default model too.

    python -m tests.record_baselines --reason "why outputs change" [--device cuda] [--only NAME]

A change that means to alter outputs runs this in the same commit and says why there.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from tests.baseline_models import TINY_MODELS, baseline_path
from tf_async import baseline
from tf_async.models.default import default_model_path
from tf_async.models.loader import load_checkpoint


def _record_one(name: str, path: Path, device: str, reason: str) -> None:
    settings = baseline.BaselineSettings(device=device)
    doc = asyncio.run(baseline.record(load_checkpoint(path), settings, reason=reason,
                                      model_name=name))
    baseline.write(doc, baseline_path(name, device))
    print(f"{name}: {baseline_path(name, device)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reason", required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--only", nargs="*", default=None, help="names (tiny models or default)")
    args = parser.parse_args()
    names = args.only or [*TINY_MODELS, *(["default"] if args.device == "cpu" else [])]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name == "default":
                _record_one(name, Path(default_model_path()), args.device, args.reason)
            else:
                _record_one(name, TINY_MODELS[name](Path(tmp) / name), args.device, args.reason)


if __name__ == "__main__":
    main()

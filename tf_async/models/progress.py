"""Loading progress of a checkpoint: a bar on a terminal, nothing otherwise.

Loaders call `advance(num_bytes)` for each tensor they read; `load_checkpoint` makes the
object (from the weight files' sizes on disk) and calls `finish()`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

MIN_BAR_BYTES = 256 * 1024 * 1024  # smaller checkpoints load in a blink: no bar
WEIGHT_SUFFIXES = (".safetensors", ".gguf")
BAR_WIDTH = 30


class LoadProgress:
    """Bytes of tensors read out of `total_bytes`, drawn at most every `interval_s`."""

    def __init__(self, label: str, total_bytes: int, stream: TextIO | None = None, *,
                 min_bytes: int = MIN_BAR_BYTES, interval_s: float = 0.1):
        self.label = label
        self.total_bytes = max(total_bytes, 1)
        self.num_bytes = 0
        self.num_tensors = 0
        self.stream = stream if stream is not None else sys.stderr
        self.visible = total_bytes >= min_bytes and _is_tty(self.stream)
        self.interval_s = interval_s
        self._start_s = time.monotonic()
        self._drawn_s = 0.0
        self._finished = False

    @classmethod
    def for_path(cls, path: Path, stream: TextIO | None = None) -> LoadProgress:
        """Progress of loading the model at `path` (a file, or a folder of weight files)."""
        files = [path] if path.is_file() else [
            p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES]
        return cls(f"loading {path.name}", sum(p.stat().st_size for p in files), stream)

    def advance(self, num_bytes: int) -> None:
        self.num_bytes += num_bytes
        self.num_tensors += 1
        now_s = time.monotonic()
        if self.visible and now_s - self._drawn_s >= self.interval_s:
            self._drawn_s = now_s
            self._draw(min(self.num_bytes, self.total_bytes))

    def finish(self) -> None:
        """Draw the full bar and end its line (once)."""
        if self.visible and not self._finished:
            self._draw(self.total_bytes)
            self.stream.write(f" {time.monotonic() - self._start_s:.1f} s\n")
            self.stream.flush()
        self._finished = True

    def _draw(self, num_bytes: int) -> None:
        filled = BAR_WIDTH * num_bytes // self.total_bytes
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {100 * num_bytes // self.total_bytes:3d}% "
                          f"{num_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB, "
                          f"{self.num_tensors} tensors")
        self.stream.flush()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False

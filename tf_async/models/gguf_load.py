"""Loading a GGUF file: the loader is chosen by its architecture (llama, qwen2, qwen3,
qwen3moe: models/gguf_io.py; the qwen35 / qwen35moe hybrids: models/gguf_qwen35.py)."""

from __future__ import annotations

import os

from .checkpoint import Checkpoint
from .gguf_io import HYBRID_GGUF_ARCHS, load_dense_gguf, open_gguf_with_metadata
from .gguf_qwen35 import load_qwen35_gguf
from .progress import LoadProgress


def load_gguf(path: str | os.PathLike, progress: LoadProgress | None = None) -> Checkpoint:
    """Load a GGUF v3 checkpoint with its tokenizer.

    Raises ModelFormatError naming the file (and tensor) for a missing, truncated or
    malformed file, an unknown architecture or an unsupported tensor type."""
    reader, metadata = open_gguf_with_metadata(path)
    if metadata.get("general.architecture") in HYBRID_GGUF_ARCHS:
        return load_qwen35_gguf(reader, metadata, str(path), progress)
    return load_dense_gguf(reader, metadata, str(path), progress)

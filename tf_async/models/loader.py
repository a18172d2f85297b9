"""The one entry point that turns a model path into a Checkpoint, and the table that turns
a checkpoint into its decoder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..backend.base import Ops
from ..errors import ModelFormatError
from .checkpoint import Checkpoint
from .config import SUPPORTED_ARCHS
from .decoder import Decoder
from .progress import LoadProgress
from .protocol import DecoderProtocol
from .qwen35 import HYBRID_ARCHS, HybridDecoder


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face / MLX folder (config.json + safetensors).

    Anything else (a missing path, another kind of file) is a ModelFormatError.
    """
    model_path = Path(path).expanduser()
    if not model_path.exists():
        raise ModelFormatError(f"{model_path}: model path does not exist")
    progress = LoadProgress.for_path(model_path)  # a bar on a terminal, for large checkpoints
    try:
        return _load(model_path, progress)
    finally:
        progress.finish()


def _load(model_path: Path, progress: LoadProgress) -> Checkpoint:
    if model_path.is_dir():
        from .hf import load_hf_folder
        from .hf_qwen35 import is_hybrid_folder, load_qwen35_folder

        if is_hybrid_folder(model_path):  # qwen3_5 / qwen3_5_moe: the hybrid loader
            return load_qwen35_folder(model_path, progress)
        return load_hf_folder(model_path, progress)
    if model_path.suffix.lower() == ".gguf":
        from .gguf_load import load_gguf  # lazy: only GGUF models need the GGUF reader

        return load_gguf(str(model_path), progress)
    raise ModelFormatError(
        f"{model_path}: not a model; expected a .gguf file or a folder with config.json "
        "and model.safetensors (Hugging Face or MLX)"
    )


def _dense_decoder(checkpoint: Checkpoint, ops: Ops, num_lanes: int) -> DecoderProtocol:
    return Decoder(checkpoint, ops)


def _hybrid_decoder(checkpoint: Checkpoint, ops: Ops, num_lanes: int) -> DecoderProtocol:
    decoder = HybridDecoder(checkpoint, ops)
    decoder.attach_states(decoder.new_states(num_lanes))  # one state slot a lane
    return decoder


# architecture (ModelConfig.arch) -> (checkpoint, ops, number of lanes) -> its decoder
DECODERS: dict[str, Callable[[Checkpoint, Ops, int], DecoderProtocol]] = {
    **{arch: _dense_decoder for arch in SUPPORTED_ARCHS},
    **{arch: _hybrid_decoder for arch in HYBRID_ARCHS},
}


def make_decoder(checkpoint: Checkpoint, ops: Ops, *, num_lanes: int = 1) -> DecoderProtocol:
    """The decoder of the checkpoint's architecture (hybrids: with a RecurrentStates store
    for `num_lanes` lanes attached)."""
    make = DECODERS.get(checkpoint.config.arch)
    if make is None:
        raise ModelFormatError(f"no decoder for architecture {checkpoint.config.arch!r}; "
                               f"known: {sorted(DECODERS)}")
    return make(checkpoint, ops, num_lanes)

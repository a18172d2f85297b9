"""Assemble an engine from options: checkpoint -> ops -> decoder -> arena -> lanes -> core."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend.base import Ops
from ..backend.select import make_ops
from ..errors import BadInputError
from ..models.checkpoint import Checkpoint
from ..models.decoder import Decoder
from ..models.qwen35 import make_decoder
from .core import EngineCore
from .lanes import Lanes
from .pages import Runs, pages_for_rows
from .prefix import StateSlots
from .runner import KV_DTYPES, Arena, Runner
from .sched import Scheduler
from .sequence import TokenEvent


@dataclass(slots=True)
class EngineParts:
    checkpoint: Checkpoint
    ops: Ops
    decoder: Decoder  # or a HybridDecoder (qwen3_5 / qwen3_5_moe) with its lanes' states
    arena: Arena
    lanes: Lanes
    scheduler: Scheduler
    runner: Runner
    core: EngineCore
    model_name: str
    eos_ids: tuple[int, ...]
    vocab_size: int
    num_lanes: int


def validate_options(o: dict[str, Any]) -> None:
    def need(cond: bool, message: str, param: str) -> None:
        if not cond:
            raise BadInputError(message, param=param)

    need(isinstance(o["parallel"], int) and 1 <= o["parallel"] <= 1024, "parallel must be in [1, 1024]", "parallel")
    need(isinstance(o["ctx"], int) and 2 <= o["ctx"] <= 1 << 20, "ctx must be in [2, 1048576]", "ctx")
    need(o["kv_dtype"] in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}", "kv_dtype")
    need(isinstance(o["page_size"], int) and 1 <= o["page_size"] <= 1024, "page_size must be in [1, 1024]", "page_size")
    need(isinstance(o["step_tokens"], int) and o["step_tokens"] >= 1, "step_tokens must be >= 1", "step_tokens")
    need(isinstance(o["draft_tokens"], int) and 1 <= o["draft_tokens"] <= 16, "draft_tokens must be in [1, 16]", "draft_tokens")
    steps = o.get("decode_steps", 1)
    need(isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= 64,
         "decode_steps must be in [1, 64]", "decode_steps")
    per_lane = pages_for_rows(o["ctx"], o["page_size"])
    kv_pages = o["kv_pages"]
    need(kv_pages is None or (isinstance(kv_pages, int) and kv_pages >= per_lane),
         f"kv_pages must be at least ctx / page_size = {per_lane} so that one stream fits", "kv_pages")


def load_model(model: str | Checkpoint | None) -> Checkpoint:
    if isinstance(model, Checkpoint):
        return model
    from ..models.default import default_model_path
    from ..models.loader import load_checkpoint

    return load_checkpoint(model if model is not None else default_model_path())


def build_engine(options: dict[str, Any], publish: Callable[[list[TokenEvent]], None],
                 ) -> EngineParts:
    validate_options(options)
    ckpt = load_model(options["model"])
    ops = make_ops(options["device"])
    num_lanes = options["parallel"]
    decoder = make_decoder(ckpt, ops, num_lanes=num_lanes)  # hybrids: one state slot a lane
    per_lane = pages_for_rows(options["ctx"], options["page_size"])
    num_pages = options["kv_pages"] or per_lane * num_lanes
    recurrent = getattr(decoder, "states", None) is not None
    runs = Runs(paging=options["paging"], num_lanes=num_lanes, pages_per_lane=per_lane,
                page_size=options["page_size"], num_pages=num_pages,
                prefix_cache=_prefix_cache_applies(options, recurrent))
    kv_scales = kv_scales_for(decoder, ckpt, options["kv_dtype"])
    arena = Arena(ops, decoder, num_pages=runs.num_pages_total, page_size=options["page_size"],
                  kv_dtype=options["kv_dtype"], kv_scales=kv_scales)
    lanes = Lanes(num_lanes, runs, drain=ops.synchronize)
    scheduler = Scheduler(lanes, step_tokens=options["step_tokens"], ctx=options["ctx"],
                          recurrent=recurrent, decode_steps=options.get("decode_steps", 1),
                          cache_identity=kv_identity(ckpt, options["kv_dtype"], kv_scales))
    if recurrent and runs.cache is not None:
        decoder.states.add_prefix_slots(num_lanes)  # type: ignore[attr-defined]
        scheduler.state_slots = StateSlots(num_lanes)
    runner = Runner(_maybe_graphs(decoder, options), arena)
    core = EngineCore(scheduler, runner, publish)
    if options.get("drafter"):
        from .drafting import attach_drafter

        attach_drafter(options, ckpt, scheduler, runner, lanes)
    name = os.path.basename(str(ckpt.path).rstrip("/")) or ckpt.config.name
    eos = ckpt.config.eos_token_ids or tuple(ckpt.tokenizer.eos_token_ids)
    return EngineParts(ckpt, ops, decoder, arena, lanes, scheduler, runner, core, name,
                       tuple(eos), ckpt.config.vocab_size, num_lanes)


def _prefix_cache_applies(options: dict[str, Any], recurrent: bool) -> bool:
    """Prefix reuse needs paged KV; hybrids resume from recurrent states kept at page
    boundaries (one slot a lane). Not with ring drafters (draft model, MTP: their rings follow
    every row of the target): those recompute their prompts as before."""
    drafter = options.get("drafter") or ""
    ring_drafter = drafter == "mtp" or drafter.startswith("draft:")
    return bool(options.get("prefix_cache", True)) and options["paging"] and not ring_drafter


def kv_identity(ckpt: Checkpoint, kv_dtype: str, kv_scales: Any) -> bytes:
    """Everything besides the tokens that decides a page's KV: the model, the KV dtype and its
    scales (the prefix cache's root key hashes it)."""
    digest = hashlib.sha256(repr(ckpt.config).encode())
    digest.update(repr(sorted(ckpt.meta.items(), key=lambda kv: kv[0])).encode())
    digest.update(kv_dtype.encode())
    if kv_scales is not None:
        digest.update(np.asarray(kv_scales, np.float32).tobytes())
    return digest.digest()


def _maybe_graphs(decoder: Decoder, options: dict[str, Any]) -> Decoder:
    """With `cuda_graphs` on a CUDA device, decode-shaped rounds of a dense model replay a
    captured CUDA graph (one launch instead of ~700); everything else runs eagerly."""
    if not options.get("cuda_graphs") or decoder.ops.name != "cuda" or hasattr(decoder, "states"):
        return decoder
    from ..models.graph_decoder import GraphDecoder

    return GraphDecoder(decoder)  # type: ignore[return-value]


def kv_scales_for(decoder: Decoder, ckpt: Checkpoint, kv_dtype: str):  # noqa: ANN201
    """Per-layer fp8 K/V scales calibrated on the model, or None for f32/bf16."""
    if kv_dtype != "fp8":
        return None
    from .calibrate import CALIBRATION_TEXT, fp8_kv_scales

    return fp8_kv_scales(decoder, ckpt.tokenizer.encode(CALIBRATION_TEXT))

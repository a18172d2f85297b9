"""Assemble an engine from options: checkpoint -> ops -> decoder -> arena -> lanes -> core."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..backend.base import Array, Ops, graph_ops
from ..backend.comm import make_group
from ..backend.select import make_ops, resolve_device
from ..models.checkpoint import Checkpoint
from ..models.decoder import Decoder
from ..models.graph_decoder import GraphDecoder
from ..models.loader import make_decoder
from ..models.protocol import DecoderProtocol
from ..models.qwen35 import HYBRID_ARCHS, HybridDecoder
from ..models.tp_decoder import TPDecoder
from ..models.tp_hybrid import TPHybridDecoder, check_hybrid_tensor_parallel
from ..models.tp_shard import check_tensor_parallel
from .calibrate import kv_scales_for
from .core import EngineCore
from .drafters.registry import attach_drafter
from .lanes import Lanes
from .options import EngineOptions
from .pages import Runs, pages_for_rows
from .prefix import StateSlots
from .runner import Arena, Runner
from .sched import Scheduler
from .sequence import TokenEvent
from .threads import KERNEL_LOCK, choose_threading_layer


@dataclass(slots=True)
class EngineParts:
    checkpoint: Checkpoint
    ops: Ops
    decoder: DecoderProtocol  # a HybridDecoder (qwen3_5 / qwen3_5_moe) holds its lanes' states
    arena: Arena
    lanes: Lanes
    scheduler: Scheduler
    runner: Runner
    core: EngineCore
    model_name: str
    eos_ids: tuple[int, ...]
    vocab_size: int
    num_lanes: int


def load_model(model: str | Checkpoint | None) -> Checkpoint:
    if isinstance(model, Checkpoint):
        return model
    from ..models.default import default_model_path
    from ..models.loader import load_checkpoint

    return load_checkpoint(model if model is not None else default_model_path())


def build_engine(options: EngineOptions, publish: Callable[[list[TokenEvent]], None],
                 ) -> EngineParts:
    choose_threading_layer()
    with KERNEL_LOCK:  # loading may run kernels (fp8 calibration, zeroing)
        return _build(options, publish)


def _build(options: EngineOptions, publish: Callable[[list[TokenEvent]], None]) -> EngineParts:
    ckpt = load_model(options.model)
    num_lanes = options.parallel
    tp = _tensor_parallel(ckpt, options)
    decoder: DecoderProtocol = (tp if tp is not None else  # hybrids: one state slot a lane
                                make_decoder(ckpt, make_ops(options.device), num_lanes=num_lanes))
    split = None if tp is None else tp.group
    ops = decoder.ops  # tensor parallel: rank 0's (batches, logits and sampling live there)
    recurrent = decoder.states is not None
    runs = _make_runs(options, prefix_cache=_prefix_cache_applies(options))
    kv_scales = kv_scales_for(decoder, ckpt, options.kv_dtype)
    arena = Arena(ops, decoder, num_pages=runs.num_pages_total, page_size=options.page_size,
                  kv_dtype=options.kv_dtype, kv_scales=kv_scales, split=split)
    lanes = Lanes(num_lanes, runs, drain=ops.synchronize if split is None else split.synchronize)
    scheduler = Scheduler(lanes, step_tokens=options.step_tokens, ctx=options.ctx,
                          recurrent=recurrent, decode_steps=options.decode_steps,
                          draft_backoff=options.draft_backoff,
                          cache_identity=kv_identity(ckpt, options.kv_dtype, kv_scales))
    states = decoder.states
    if states is not None and runs.cache is not None:
        num_slots = options.num_prefix_states(num_lanes)
        states.add_prefix_slots(num_slots)
        scheduler.prefix.state_slots = StateSlots(num_slots, options.prefix_state_pages)
    runner = Runner(_maybe_graphs(decoder, options.cuda_graphs), arena)
    core = EngineCore(scheduler, runner, publish)
    if options.drafter:
        attach_drafter(options, ckpt, scheduler, runner, lanes)
    name = os.path.basename(str(ckpt.path).rstrip("/")) or ckpt.config.name
    eos = ckpt.config.eos_token_ids or tuple(ckpt.tokenizer.eos_token_ids)
    return EngineParts(ckpt, ops, decoder, arena, lanes, scheduler, runner, core, name,
                       tuple(eos), ckpt.config.vocab_size, num_lanes)


def _tensor_parallel(ckpt: Checkpoint, options: EngineOptions,
                     ) -> TPDecoder | TPHybridDecoder | None:
    """The decoder split over options.tensor_parallel ranks (None at 1): fake ranks on the
    CPU, one GPU a rank on CUDA. Refuses a size that does not divide the model's heads or
    intermediate columns (checked before any GPU is touched) and more ranks than GPUs."""
    size = options.tensor_parallel
    if size == 1:
        return None
    hybrid = ckpt.config.arch in HYBRID_ARCHS
    if hybrid:
        check_hybrid_tensor_parallel(ckpt, size)
    else:
        check_tensor_parallel(ckpt, size)
    rank_ops, comm = make_group(resolve_device(options.device), size)
    if hybrid:
        return TPHybridDecoder(ckpt, rank_ops, comm, options.parallel)
    return TPDecoder(ckpt, rank_ops, comm)


def _make_runs(options: EngineOptions, *, prefix_cache: bool) -> Runs:
    per_lane = pages_for_rows(options.ctx, options.page_size)
    num_pages = options.kv_pages or per_lane * options.parallel
    return Runs(paging=options.paging, num_lanes=options.parallel, pages_per_lane=per_lane,
                page_size=options.page_size, num_pages=num_pages, prefix_cache=prefix_cache)


def _prefix_cache_applies(options: EngineOptions) -> bool:
    """Prefix reuse needs paged KV; hybrids resume from recurrent states kept at page
    boundaries, ring drafters rebuild their rings for the reused prefix (docs/PREFIX_CACHE.md)."""
    return options.prefix_cache and options.paging


def kv_identity(ckpt: Checkpoint, kv_dtype: str, kv_scales: Array | None) -> bytes:
    """Everything besides the tokens that decides a page's KV: the model, the KV dtype and its
    scales (the prefix cache's root key hashes it)."""
    digest = hashlib.sha256(repr(ckpt.config).encode())
    digest.update(repr(sorted(ckpt.meta.items(), key=lambda kv: kv[0])).encode())
    digest.update(kv_dtype.encode())
    if kv_scales is not None:
        digest.update(np.asarray(kv_scales, np.float32).tobytes())
    return digest.digest()


def _maybe_graphs(decoder: DecoderProtocol, cuda_graphs: bool) -> DecoderProtocol:
    """With `cuda_graphs` on ops that capture graphs, decode-shaped rounds of a dense or
    hybrid model replay a captured CUDA graph (one launch instead of ~700 to ~1,000);
    everything else runs eagerly (tensor-parallel decoders too)."""
    if not cuda_graphs or graph_ops(decoder.ops) is None:
        return decoder
    if not isinstance(decoder, Decoder | HybridDecoder):
        return decoder
    return GraphDecoder(decoder)

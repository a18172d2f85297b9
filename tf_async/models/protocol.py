"""The Decoder protocol: what the engine calls on a model, whatever its architecture.

Implemented by the dense `Decoder` (decoder.py), `HybridDecoder` (qwen35.py: recurrent state
a lane), `GraphDecoder` (graph_decoder.py: decode rounds replayed from CUDA graphs) and the
MTP head (mtp.py: one stream's slots, the target's hidden rows in `batch.hidden_in`, its K/V
in the drafter's ring passed as `kv`).
`loader.make_decoder` picks the implementation by architecture.
"""

from __future__ import annotations

from typing import Protocol

from ..backend.base import Array, Ops
from ..backend.weights import Linear
from .batch_io import ForwardBatch
from .config import ModelConfig
from .qwen35 import LaneStates


class EmbedWeights(Protocol):
    @property
    def embed(self) -> Linear: ...  # [V, H]: its out_features is the vocabulary bound of ids
    @property
    def lm_head(self) -> Linear: ...  # [V, H] (a DFlash drafter scores its block with it)


class DecoderProtocol(Protocol):
    config: ModelConfig  # of the KV layers (what the arena is sized by)

    @property
    def ops(self) -> Ops: ...

    @property
    def weights(self) -> EmbedWeights: ...

    @property
    def states(self) -> LaneStates | None:
        """Per-lane recurrent state (hybrids), None for attention-only models."""
        ...

    def forward(self, batch: ForwardBatch, kv: Array, kv_scales: Array, *,
                all_hidden: bool = False) -> tuple[Array, Array]:
        """Run the rows: (logits [m, V] of batch.logit_rows, final-normed hidden [m, H] of
        those rows, or [rows, H] of every row with `all_hidden`; with `all_hidden` and
        batch.capture_layers: those layers' outputs side by side, [rows, len * H])."""
        ...

    def commit_states(self, commits: tuple[tuple[int, int], ...]) -> None:
        """Hybrids: advance frozen (draft-verifying) lanes over their accepted rows, (lane,
        rows) each (RecurrentStates' docstring); nothing for attention-only models."""
        ...

    def one_shot(self, batch: ForwardBatch, kv: Array, kv_scales: Array) -> tuple[Array, Array]:
        """forward() touching no lane's state (fresh zero state for hybrids): calibration."""
        ...

    def argmax_of(self, logits: Array) -> Array | None:
        """The greedy ids of `logits` already computed with them (a replayed graph), else None."""
        ...

"""The MTP drafter's plug point (Qwen3.5 / Qwen3-Next, spec MODELS.md section 6).

Its area holds one attention layer's K/V ring (the MTP layer's own cache, same per-row size
as one trunk layer) and the newest row's hidden state (the target's final-normed hidden that
the next MTP step takes). The MTP forward itself comes with the Qwen3.5 issue: a checkpoint
that carries it exposes `weights.mtp` (an object with `forward(token_ids, positions,
hidden, ring, kv_scales) -> (logits, hidden)`); until then every model is refused clearly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import BadInputError
from ..area import AreaLayout

if TYPE_CHECKING:
    from ...models.checkpoint import Checkpoint


def find_mtp_head(ckpt: Checkpoint) -> Any | None:
    """The checkpoint's MTP layer, detected by tensor presence (`mtp.fc.weight`) at load."""
    return getattr(ckpt.weights, "mtp", None)


def mtp_layout(ckpt: Checkpoint, capacity: int, kv_dtype: str) -> AreaLayout:
    """One attention layer of the target's K/V shape, plus the target's hidden size."""
    return AreaLayout.for_model(ckpt.config, capacity, kv_dtype, num_layers=1)


def require_mtp_head(ckpt: Checkpoint) -> Any:
    head = find_mtp_head(ckpt)
    if head is None:
        raise BadInputError(
            f"--drafter mtp: model {ckpt.path} ({ckpt.config.arch}) has no MTP layer "
            f"(no mtp.fc.weight tensor); use --drafter ngram or --drafter draft:PATH",
            param="drafter")
    return head

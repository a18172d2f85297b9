"""The row blocks of a sorted-by-expert MoE launch (cuda_kernels/qmma.py, grouped form), built
with any array module (NumPy or CuPy): no numba import, so the CPU tests check it directly."""

from __future__ import annotations


def expert_tiles(xp, expert_ids, num_experts: int, rows_per_block: int):
    """Rows of a grouped launch sorted by expert, and its row blocks, computed with array
    module `xp` (NumPy or CuPy: no host round trip). expert_ids: [n] int32, the expert of each
    row. -> (order [n] int64: sorted row i is row order[i]; tiles [blocks, 3] int32: expert,
    first and end sorted row of each block, blocks = n // rows_per_block + num_experts (an
    upper bound known without looking at the ids; blocks past the last run are empty)).
    Any order inside an expert's run gives the same bits (each row is computed alone)."""
    ids = expert_ids.astype(xp.int64)
    order = xp.argsort(ids)
    experts = xp.arange(num_experts, dtype=xp.int64)  # (searchsorted, not CuPy's bincount,
    starts = xp.searchsorted(ids[order], experts, side="left")  # which syncs for max(ids))
    counts = xp.searchsorted(ids[order], experts, side="right") - starts
    runs = (counts + rows_per_block - 1) // rows_per_block
    run_end = xp.cumsum(runs)
    blocks = expert_ids.shape[0] // rows_per_block + num_experts
    block = xp.arange(blocks, dtype=xp.int64)
    expert = xp.searchsorted(run_end, block, side="right")
    valid = expert < num_experts
    e = xp.minimum(expert, num_experts - 1)
    first = starts[e] + (block - (run_end[e] - runs[e])) * rows_per_block
    end = xp.minimum(first + rows_per_block, starts[e] + counts[e])
    tiles = xp.stack([e, xp.where(valid, first, 0), xp.where(valid, end, 0)], axis=1)
    return order, tiles.astype(xp.int32)


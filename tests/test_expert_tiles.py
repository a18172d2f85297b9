"""qmma.expert_tiles (the row blocks of the sorted-by-expert MoE launch), with NumPy: every
expert's sorted run is covered by blocks of at most 16 rows of that expert, once, in order."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_kernels.expert_tiles import expert_tiles


@pytest.mark.parametrize("seed", range(6))
def test_blocks_cover_each_expert_run_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts, rows_per_block = int(rng.integers(1, 20)), 16
    ids = rng.integers(0, experts, int(rng.integers(0, 300))).astype(np.int32)
    order, tiles = expert_tiles(np, ids, experts, rows_per_block)
    assert sorted(order.tolist()) == list(range(ids.shape[0]))
    assert (np.diff(ids[order]) >= 0).all()
    assert tiles.dtype == np.int32 and tiles.shape == (ids.shape[0] // rows_per_block + experts, 3)
    covered = []
    for expert, first, end in tiles.tolist():
        if first >= end:
            continue
        assert end - first <= rows_per_block and (ids[order][first:end] == expert).all()
        covered.extend(range(first, end))
    assert covered == list(range(ids.shape[0]))  # each sorted row once, blocks in order

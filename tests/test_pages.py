"""Allocator and lane lifecycle on tiny pools, with exact page ids."""

from tf_async.engine.lanes import Lanes
from tf_async.engine.pages import PagePool, Runs, pages_for_rows


def test_pool_hands_out_pages_in_fifo_order_and_refuses_what_does_not_fit():
    pool = PagePool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(2) is None and pool.num_free == 1  # nothing taken on refusal
    pool.free([3, 0])
    assert pool.allocate(3) == [5, 3, 0]
    assert pool.num_in_use == 6 and not pool.can_allocate(1)


def test_pages_for_rows_rounds_up():
    assert [pages_for_rows(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_paged_runs_grow_on_demand_and_return_pages_on_close():
    runs = Runs(paging=True, num_lanes=2, pages_per_lane=3, page_size=4, num_pages=5)
    assert runs.open(0) == [] and runs.open(1) == []
    assert runs.reserve(0, 5) == [0, 1]
    assert runs.reserve(1, 4) == [2]
    assert runs.reserve(0, 8) == []  # already covered
    assert runs.reserve(0, 9) == [3]
    assert not runs.can_reserve(1, 12) and runs.reserve(1, 12) is None
    assert runs.pages(1) == [2]  # a refused reserve takes nothing
    assert runs.close(0) == [0, 1, 3]
    assert runs.close(0) == []  # closing twice is a no-op
    assert runs.reserve(1, 12) == [4, 0]
    assert runs.num_pages_in_use == 3


def test_contiguous_runs_are_the_lanes_own_block():
    runs = Runs(paging=False, num_lanes=3, pages_per_lane=4, page_size=2, num_pages=0)
    assert runs.open(2) == [8, 9, 10, 11]
    assert runs.reserve(2, 8) == [] and runs.reserve(2, 9) is None  # never past ctx
    assert runs.num_pages_total == 12 and runs.num_pages_in_use == 4
    assert runs.close(2) == [8, 9, 10, 11] and runs.num_pages_in_use == 0


def test_lane_release_drains_first_runs_hooks_once_and_is_idempotent():
    calls: list[str] = []
    runs = Runs(paging=True, num_lanes=2, pages_per_lane=2, page_size=4, num_pages=4)
    lanes = Lanes(2, runs, drain=lambda: calls.append("drain"))
    lanes.add_release_hook(lambda lane: calls.append(f"hook{lane}:{runs.pages(lane)}"))
    assert lanes.try_open(7) == (0, [])
    assert lanes.try_open(8) == (1, [])
    assert lanes.try_open(9) is None
    runs.reserve(0, 5)
    lanes.release(0)
    lanes.release(0)
    assert calls == ["drain", "hook0:[0, 1]"]  # hook sees the run before it goes back
    assert lanes.num_in_use == 1 and runs.pool.num_free == 4
    assert lanes.try_open(10) == (0, [])  # lowest free lane
    lanes.release(0)
    lanes.release(1)
    assert lanes.num_in_use == 0 and runs.num_pages_in_use == 0 and lanes.num_releases == 3

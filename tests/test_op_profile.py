"""benchmarks/op_profile.py on a tiny model: every round's time is split into phases and ops,
the timed ops are the outermost calls, and the engine's outputs are unchanged by the timing."""

from __future__ import annotations

from benchmarks.op_profile import OpTimer, profile


async def test_profile_splits_a_round_into_phases_and_ops(tiny_llama) -> None:
    lines = await profile(tiny_llama, "cpu", streams=2, max_tokens=4, prompt_tokens=6, ctx=64)
    assert lines[0].startswith("2 stream(s), 4 tokens each: ")
    names = [line.split()[1] for line in lines[2:] if line.startswith(("op ", "phase "))]
    assert {"execute", "schedule", "update", "linear"} <= set(names)
    assert lines[-1].startswith("execute other")


async def test_phases_only_times_phases_and_no_op(tiny_llama) -> None:
    lines = await profile(tiny_llama, "cpu", streams=1, max_tokens=4, prompt_tokens=6, ctx=64,
                          drafter="ngram", phases_only=True)
    names = [line.split()[1] for line in lines[2:]]
    assert {"execute", "schedule", "update", "propose", "absorb"} <= set(names)
    assert not any(line.startswith(("op ", "execute other")) for line in lines)


def test_only_outermost_calls_are_timed() -> None:
    import threading

    class Ops:
        def outer(self) -> int:
            return self.inner() + 1

        def inner(self) -> int:
            return 1

    ops, timer = Ops(), OpTimer(None)
    timer.install_ops(ops)
    result: list[int] = []
    with timer.window():
        worker = threading.Thread(target=lambda: result.append(ops.outer()), name="tf-async-engine")
        worker.start()
        worker.join()
        ops.outer()  # not the engine thread: not timed
    assert result == [2] and timer.calls == {"op outer": 1}

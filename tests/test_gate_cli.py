"""`tf-async gate` as a user runs it: drafted == plain with ngram unless --drafter none."""

from __future__ import annotations

import pytest

from tf_async import gate
from tf_async.cli import main


@pytest.mark.parametrize("argv,want", [([], "ngram"), (["--drafter", "none"], None),
                                       (["--drafter", "mtp"], "mtp")])
def test_gate_drafts_with_ngram_by_default(monkeypatch, capsys, argv, want) -> None:
    seen = {}

    async def fake_run_gates(model, **kw):
        seen.update(kw)
        return [gate.GateRow("drafted == plain (x)", "greedy", 1, 1)], {}

    monkeypatch.setattr(gate, "run_gates", fake_run_gates)
    assert main(["gate", *argv]) == 0
    assert seen["drafter"] == want
    assert "1/1 gates pass" in capsys.readouterr().out

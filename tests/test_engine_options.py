"""EngineOptions: typed, frozen, validated once at construction; every option reachable from
Engine(...) and the CLI (none only from the environment)."""

from __future__ import annotations

import dataclasses

import pytest

from tf_async import BadInputError, Engine
from tf_async.cli import _parser
from tf_async.engine.options import EngineOptions
from tf_async.server.cli import engine_from_args


@pytest.mark.parametrize(("param", "bad"), [
    ("parallel", 0), ("ctx", 1), ("kv_dtype", "f16"), ("page_size", 0), ("step_tokens", 0),
    ("draft_tokens", 17), ("decode_steps", True), ("kv_pages", 1), ("draft_ring", 0),
    ("draft_areas", -1), ("ngram_min", 4), ("device", "tpu"), ("parallel", 2.0),
    ("prefix_state_pages", 0), ("prefix_state_slots", 0), ("prefix_state_pages", 1.5),
    ("tensor_parallel", 0), ("tensor_parallel", 65)])
def test_a_bad_option_is_one_error_naming_it(param: str, bad: object) -> None:
    with pytest.raises(BadInputError) as info:
        EngineOptions(**{"ctx": 64, "page_size": 4, param: bad})
    assert info.value.param == param
    with pytest.raises(BadInputError):  # Engine(...) checks at construction, not at start
        Engine(**{param: bad})


def test_options_are_frozen_and_carry_the_drafter_settings() -> None:
    eng = Engine(device="cpu", ctx=64, page_size=4, drafter="ngram", draft_ring=8,
                 draft_areas=1, ngram_min=1)
    options = eng.options
    assert (options.draft_ring, options.draft_areas, options.ngram_min) == (8, 1, 1)
    assert options.ring_capacity == 8 and options.num_draft_areas(4) == 1
    assert EngineOptions(ctx=64).ring_capacity == 64 and EngineOptions().num_draft_areas(3) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.ngram_min = 2  # type: ignore[misc]


def test_draft_areas_defaults_to_the_environment_only_through_the_api(monkeypatch) -> None:
    monkeypatch.setenv("TF_DRAFT_AREAS", "3")
    assert Engine().options.draft_areas == 3
    assert Engine(draft_areas=0).options.draft_areas == 0


def test_cli_flags_reach_the_engine_options() -> None:
    args = _parser().parse_args(["serve", "--draft-ring", "32", "--draft-areas", "2",
                                 "--ngram-min", "1", "--drafter", "ngram"])
    options = engine_from_args(args).options
    assert (options.draft_ring, options.draft_areas, options.ngram_min, options.drafter) == (
        32, 2, 1, "ngram")
    assert engine_from_args(_parser().parse_args(["serve"])).options.ngram_min == 2


def test_prefix_state_flags_reach_the_engine_options() -> None:
    args = _parser().parse_args(["serve", "--prefix-state-pages", "4", "--prefix-state-slots", "9"])
    options = engine_from_args(args).options
    assert (options.prefix_state_pages, options.prefix_state_slots) == (4, 9)
    defaults = engine_from_args(_parser().parse_args(["serve"])).options
    assert (defaults.prefix_state_pages, defaults.prefix_state_slots) == (16, None)
    with pytest.raises(BadInputError, match="prefix_state_pages"):
        engine_from_args(_parser().parse_args(["serve", "--prefix-state-pages", "0"]))


@pytest.mark.parametrize("command", ["serve", "gate", "bench"])
def test_tensor_parallel_flag(command: str) -> None:
    assert _parser().parse_args([command]).tensor_parallel == 1
    args = _parser().parse_args([command, "--tensor-parallel", "2"])
    assert args.tensor_parallel == 2
    if command == "serve":
        assert engine_from_args(args).options.tensor_parallel == 2

"""Engine defaults as users get them: decode rounds on a CUDA device replay CUDA graphs unless
--no-cuda-graphs (vLLM and llama.cpp do the same), and on the CPU the option changes nothing."""

from __future__ import annotations

import argparse

import pytest

from tf_async import Engine
from tf_async.cli import _parser
from tf_async.engine.build import _maybe_graphs
from tf_async.models.decoder import Decoder
from tf_async.server.cli import engine_from_args


@pytest.mark.parametrize("command", ["serve", "gate", "bench"])
def test_cuda_graphs_on_by_default_and_can_be_turned_off(command: str) -> None:
    assert _parser().parse_args([command]).cuda_graphs is True
    assert _parser().parse_args([command, "--no-cuda-graphs"]).cuda_graphs is False


def test_serve_passes_the_option_to_the_engine() -> None:
    for argv, want in (([], True), (["--no-cuda-graphs"], False)):
        args: argparse.Namespace = _parser().parse_args(["serve", *argv])
        assert engine_from_args(args).options.cuda_graphs is want
    assert Engine().options.cuda_graphs is True


def test_cpu_decoder_is_never_wrapped(tiny_llama) -> None:
    from tf_async.backend.cpu.ops import CpuOps

    decoder = Decoder(tiny_llama, CpuOps())
    assert _maybe_graphs(decoder, cuda_graphs=True) is decoder


def test_bad_engine_flag_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    from tf_async.cli import main

    assert main(["serve", "--decode-steps", "0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "tf-async serve: error: decode_steps must be in [1, 64]"

"""`tf-async bench` output: a table that says what each column is, and `--plot FILE.png`
(matplotlib, optional: a clear error without it, checked before the run)."""

from __future__ import annotations

import sys

import pytest

from tf_async.bench import BenchRow, format_table, write_plot
from tf_async.cli import main
from tf_async.errors import BadInputError

ROWS = [BenchRow(1, 8, 100.0, 900.0), BenchRow(2, 8, 180.0, 880.0), BenchRow(8, 8, 400.0, 870.0)]


def test_table_names_each_column_and_reads_per_row() -> None:
    lines = format_table(ROWS, 64).splitlines()
    assert "serving `streams` concurrent streams of 64 tokens" in lines[0]
    header = lines[2].split()
    assert header == ["lanes", "streams", "decode", "tok/s", "speed-up", "ms/token", "prefill",
                      "tok/s"]
    assert lines[3].split() == ["1", "8", "100.0", "1.00x", "10.0", "900.0"]
    assert lines[5].split() == ["8", "8", "400.0", "4.00x", "20.0", "870.0"]


def test_plot_is_a_png(tmp_path) -> None:
    path = tmp_path / "bench.png"
    write_plot(ROWS, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BadInputError, match="pip install matplotlib"):
        write_plot(ROWS, str(tmp_path / "x.png"), "test")


def test_bench_command_prints_the_table_and_writes_the_plot(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "b.png"
    argv = ["bench", "--model", str(tiny_llama_dir), "--device", "cpu", "--parallel", "1", "2",
            "--max-tokens", "4", "--plot", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lanes  streams" in out and f"plot written to {path}" in out
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_bad_plot_name_fails_before_the_run(capsys) -> None:
    assert main(["bench", "--model", "/nonexistent", "--plot", "figures.jpg"]) == 2
    assert "ending in .png" in capsys.readouterr().err

"""Loading a checkpoint shows progress: a bar on a terminal for a large checkpoint, nothing
when the output is not a terminal (logs, CI) or the checkpoint is small."""

from __future__ import annotations

import io
from pathlib import Path

from tf_async.models.loader import load_checkpoint
from tf_async.models.progress import LoadProgress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_ends_full_with_its_line() -> None:
    out = FakeTty()
    progress = LoadProgress("loading m", 4000, out, min_bytes=0, interval_s=0.0)
    for _ in range(3):
        progress.advance(1000)
    progress.finish()
    progress.finish()  # once
    text = out.getvalue()
    assert "\rloading m [" + "#" * 7 in text and " 75% " in text and "3 tensors" in text
    assert text.count("100%") == 1 and text.endswith(" s\n")


def test_quiet_when_not_a_terminal_or_small() -> None:
    for out, min_bytes in ((io.StringIO(), 0), (FakeTty(), 10_000)):
        progress = LoadProgress("loading m", 4000, out, min_bytes=min_bytes, interval_s=0.0)
        progress.advance(4000)
        progress.finish()
        assert out.getvalue() == ""


def test_loaders_report_every_tensor_read(tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    from tests.tiny import random_hf_weights, tiny_config
    from tests.tiny_gguf import write_gguf
    from tf_async.models.gguf_load import load_gguf
    from tf_async.models.hf import load_hf_folder

    progress = LoadProgress.for_path(tiny_llama_dir, FakeTty())
    load_hf_folder(tiny_llama_dir, progress)
    assert progress.num_tensors > 0
    assert 0.9 * progress.total_bytes <= progress.num_bytes <= progress.total_bytes

    cfg = tiny_config("llama")
    gguf = str(write_gguf(tmp_path / "m.gguf", cfg, random_hf_weights(cfg, seed=2)))
    progress = LoadProgress.for_path(Path(gguf), FakeTty())
    load_gguf(gguf, progress)
    assert progress.num_tensors > 0 and progress.num_bytes <= progress.total_bytes

    load_checkpoint(tiny_llama_dir)  # small, and pytest's stderr is no terminal: no bar
    assert capsys.readouterr().err == ""

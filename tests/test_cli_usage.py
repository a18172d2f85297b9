"""The CLI as a new user meets it: the command list, --version, --help with every flag
explained and its default shown, and a port in use refused in one line before any model
is loaded."""

from __future__ import annotations

import argparse
import socket

import pytest

import tf_async
from tf_async.cli import _parser, main

COMMANDS = ("serve", "chat", "gate", "bench")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_bare_command_prints_the_command_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command}" in out, out
    assert "--version" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tf-async {tf_async.__version__}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_help_shows_defaults(command: str) -> None:
    sub = _subparsers()[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings} has no help text"
    text = " ".join(sub.format_help().split())
    assert "(default:" in text
    if command == "serve":
        for shown in ("--port PORT", "(default: 8000)", "(default: 127.0.0.1)",
                      "--shutdown-timeout"):
            assert shown in text, shown


def test_help_never_prints_an_api_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TF_API_KEY", "s3cret")
    assert "s3cret" not in _subparsers()["serve"].format_help()


def test_port_in_use_is_one_line_and_exit_2_before_loading_the_model(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model path that does not exist: were it loaded first, that would be the error.
        code = main(["serve", "--port", str(port), "--model", str(tmp_path / "missing")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"tf-async serve: error: port {port} on 127.0.0.1 is in use"), err
    assert "--port" in err


def test_bad_host_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    code = main(["serve", "--host", "no.such.host.invalid", "--port", "0",
                 "--model", str(tmp_path / "missing")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no.such.host.invalid" in err, err

"""`tf-async`: serve, chat, gate, bench."""

from __future__ import annotations

import argparse
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, but not for flags that have none, nor for defaults read
    from the environment (an API key must not be printed)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "") or "(env " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    from . import __version__
    from .server.cli import add_chat_args, add_decode_steps_arg, add_model_args, add_serve_args

    parser = argparse.ArgumentParser(
        prog="tf-async", description="tf_async: an LLM serving engine (OpenAI-compatible HTTP, "
        "SSE, websockets, web chat page).", formatter_class=_HelpFormatter,
        epilog="`tf-async COMMAND --help` lists the flags of a command.")
    parser.add_argument("--version", action="version", version=f"tf-async {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text,
                              formatter_class=_HelpFormatter)

    add_serve_args(command("serve", "serve a model: OpenAI API at /v1, web chat at /"))
    add_chat_args(command("chat", "chat in the terminal with a running server (or in-process)"))
    gate = command("gate", "run the gates (drafted == plain, concurrent == solo, ...) and "
                   "print a table")
    add_model_args(gate)
    gate.set_defaults(drafter="ngram")  # drafted == plain with ngram unless --drafter none
    gate.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    gate.add_argument("--record", metavar="FILE", default=None,
                      help="write the gate prompts' outputs (tokens, top log-probs) to FILE")
    gate.add_argument("--reason", default="", help="with --record: why this baseline was made")
    gate.add_argument("--against", metavar="FILE", default=None,
                      help="run the requests of a recorded baseline with new features off and "
                           "compare token for token (log-probs within its tolerance)")
    gate.add_argument("--tolerance", type=float, default=None,
                      help="with --against: allowed log-prob difference (default: the file's)")
    bench = command("bench", "measure prefill and aggregate decode throughput; print a table")
    add_model_args(bench)
    bench.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4, 8],
                       help="lane counts to measure, one engine each; every row sends as many "
                            "streams as the largest")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens generated per stream")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="also draw the figures against --parallel into this PNG "
                            "(needs matplotlib)")
    add_decode_steps_arg(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `tf-async`: the command list
        parser.print_help()
        return 0
    from .errors import BadInputError

    try:
        return _run(args)
    except BadInputError as exc:  # a bad flag or model: its message, not a traceback
        print(f"tf-async {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve" and args.replicas > 1:
        from .serving.cli import run_replicas  # N engines behind one front

        return run_replicas(args)
    if args.command == "serve":
        from .server.cli import run_serve

        return run_serve(args) or 0
    if args.command == "chat":
        from .server.cli import run_chat

        return run_chat(args) or 0
    if args.command == "gate" and (args.record or args.against):
        from .baseline_cli import main_baseline  # baseline imports gate: not the other way

        return main_baseline(args)
    if args.command == "gate":
        from .gate import main_gate

        return main_gate(args)
    from .bench import main_bench

    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())

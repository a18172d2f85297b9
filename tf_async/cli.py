"""`tf-async`: serve, chat, gate, bench."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tf-async", description="tf_async LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    from .server.cli import add_chat_args, add_decode_steps_arg, add_model_args, add_serve_args

    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    add_chat_args(sub.add_parser("chat", help="terminal chat client"))
    gate = sub.add_parser("gate", help="run the gates and print a table")
    add_model_args(gate)
    gate.set_defaults(drafter="ngram")  # drafted == plain with ngram unless --drafter none
    gate.add_argument("--max-tokens", type=int, default=16)
    gate.add_argument("--record", metavar="FILE", default=None,
                      help="write the gate prompts' outputs (tokens, top log-probs) to FILE")
    gate.add_argument("--reason", default="", help="with --record: why this baseline was made")
    gate.add_argument("--against", metavar="FILE", default=None,
                      help="run the requests of a recorded baseline with new features off and "
                           "compare token for token (log-probs within its tolerance)")
    gate.add_argument("--tolerance", type=float, default=None,
                      help="with --against: allowed log-prob difference (default: the file's)")
    bench = sub.add_parser("bench", help="decode/prefill throughput of the engine")
    add_model_args(bench)
    bench.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4, 8])
    bench.add_argument("--max-tokens", type=int, default=64)
    add_decode_steps_arg(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .errors import BadInputError

    try:
        return _run(args)
    except BadInputError as exc:  # a bad flag or model: its message, not a traceback
        print(f"tf-async {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from .server.cli import run_serve

        return run_serve(args) or 0
    if args.command == "chat":
        from .server.cli import run_chat

        return run_chat(args) or 0
    if args.command == "gate":
        from .gate import main_gate

        return main_gate(args)
    from .bench import main_bench

    return main_bench(args)


if __name__ == "__main__":
    sys.exit(main())

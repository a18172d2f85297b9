"""`tf-async serve --replicas N`: N child engines and one front on the user's host/port."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from ..server.app import start_server
from ..server.cli import StopSignals, check_port_free, serve_parser
from .fleet import ReplicaSet, ReplicaSetError
from .front import create_front_app
from .policy import RoutingPolicy
from .supervisor import ReplicaSpec, replica_env

# Serve flags the front keeps for itself (children: loopback, a free port, key from env).
_FRONT_ONLY = frozenset({"host", "port", "api_key", "replicas", "affinity_margin", "help"})
STOP_GRACE_S = 30.0  # after a child's own --shutdown-timeout, before it is killed


def child_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The `tf-async serve` flags of a replica: every serve flag as given to the front
    (from the same parser, so no flag list is written twice) but the front's own."""
    parser = serve_parser()
    flags: list[str] = ["--host", "127.0.0.1", "--port", "0"]
    for action in parser._actions:  # argparse has no public way to list its actions
        if action.dest in _FRONT_ONLY or not action.option_strings:
            continue
        flags += _flag_of(action, vars(args).get(action.dest))
    return tuple(flags)


def _flag_of(action: argparse.Action, value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        name = action.option_strings[0]
        return [name if value else "--no-" + name[2:]]
    if isinstance(value, list | tuple):
        return [action.option_strings[0], *map(str, value)]
    return [action.option_strings[0], str(value)]


def replica_specs(args: argparse.Namespace) -> list[ReplicaSpec]:
    flags = child_flags(args)
    num_cores = os.cpu_count() or 1
    return [ReplicaSpec(i, flags, replica_env(i, args.replicas, args.device, num_cores,
                                              args.tensor_parallel)
                        + ((("TF_API_KEY", args.api_key),) if args.api_key else ()))
            for i in range(args.replicas)]


def run_replicas(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM, then stop every replica (each drains its streams)."""
    check_port_free(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        return asyncio.run(_serve_replicas(args))
    except KeyboardInterrupt:
        return 130


async def _serve_replicas(args: argparse.Namespace) -> int:
    replicas = ReplicaSet(replica_specs(args), RoutingPolicy(args.replicas, args.affinity_margin),
                          api_key=args.api_key)
    app = create_front_app(replicas, api_key=args.api_key, cors_origin=args.cors_origin,
                           max_body_bytes=args.max_body_bytes)
    runner, port = await start_server(app, args.host, args.port)
    signals = StopSignals(asyncio.get_running_loop())
    print(f"tf-async: starting {args.replicas} replicas of {args.model or 'the default model'} "
          f"(device {args.device}) behind http://{args.host}:{port}", flush=True)
    await replicas.start()
    code = await _until_stopped(replicas, signals, args, port)
    for site in list(runner.sites):  # no new connections; open streams go on while draining
        await site.stop()
    stop_task = asyncio.create_task(replicas.stop(args.shutdown_timeout + STOP_GRACE_S))
    await asyncio.wait({stop_task, asyncio.ensure_future(signals.second.wait())},
                       return_when=asyncio.FIRST_COMPLETED)
    if not stop_task.done():  # a second Ctrl-C: the children stop at once too
        replicas.signal_all(signal.SIGINT)
        await stop_task
    await runner.cleanup()
    print("tf-async: stopped (every replica exited)", flush=True)
    return code


async def _until_stopped(replicas: ReplicaSet, signals: StopSignals,
                         args: argparse.Namespace, port: int) -> int:
    """Serve until a signal; 2 when a replica could not start at all."""
    ready = asyncio.ensure_future(replicas.wait_all_ready())
    stop = asyncio.ensure_future(signals.first.wait())
    await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        stop.cancel()
        print(f"tf-async serve: error: {ready.exception()}", file=sys.stderr, flush=True)
        return 2
    if not stop.done():
        name = replicas.replicas[0].model_name
        print(f"tf-async: serving {name} on http://{args.host}:{port} ({args.replicas} "
              f"replicas; OpenAI API at /v1; Ctrl-C to stop)", flush=True)
        await stop
    ready.cancel()
    print(f"tf-async: shutting down: stopping {args.replicas} replicas (each drains for up to "
          f"{args.shutdown_timeout:g} s; Ctrl-C again to stop now)", flush=True)
    return 0


__all__ = ["ReplicaSetError", "child_flags", "run_replicas"]

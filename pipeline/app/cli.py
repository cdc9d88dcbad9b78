"""``kvsidecar``: serve, demo, engine-sim, status, explain, graph, bench, keygen, disk.

Exit codes: 0 clean shutdown (or a demo whose every byte verified), 1 failure at run
time, 2 bad configuration or arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import structlog

from pipeline.app import process
from pipeline.app.logs import configure_logging
from pipeline.core.config import Config, load_config, read_config
from pipeline.core.errors import ConfigError, KVSidecarError

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_CONFIG = 0, 1, 2


async def serve(config: Config) -> None:
    """Run a sidecar until SIGTERM or SIGINT, then drain and return."""
    from pipeline.app.service import run_sidecar

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    structlog.get_logger("kvsidecar").info("sidecar.signal", signal=signum.name)
                    stop.set()
                    return

        tg.start_soon(stop_on_signal)
        async with anyio.create_task_group() as sidecar:
            await sidecar.start(run_sidecar, config, stop)
            process.after_start()
        tg.cancel_scope.cancel()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvsidecar", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser("serve", help="run a sidecar until SIGTERM")
    serve_cmd.add_argument("--config", help="YAML config (default: built-in defaults)")
    serve_cmd.add_argument("--endpoint", help="override server.endpoint (ipc:// or tcp://)")
    serve_cmd.add_argument("--test-config", help=argparse.SUPPRESS)  # faults and constants

    demo = commands.add_parser("demo", help="a sidecar plus two simulated engines, verified")
    demo.add_argument("--config", help="sidecar YAML config (default: configs/default.yaml)")
    demo.add_argument("--requests", type=int, default=48, help="requests per engine")
    demo.add_argument(
        "--layout",
        default="qwen3-next-hybrid",
        help="layout preset name in configs/layouts or a YAML path",
    )

    sim = commands.add_parser("engine-sim", help="a simulated engine driving a sidecar")
    sim.add_argument("--endpoint", required=True)
    sim.add_argument("--layout", default="qwen3-next-hybrid")
    sim.add_argument("--engine-id", default=None)
    sim.add_argument("--requests", type=int, default=32)
    sim.add_argument("--prefixes", type=int, default=4, help="shared prefixes in the workload")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--concurrency", type=int, default=4)
    sim.add_argument(
        "--block-scale",
        type=int,
        default=0,
        help="block size of the scaled-down preset (0: as in the preset)",
    )
    sim.add_argument("--json", action="store_true", help="print the report as JSON")

    status = commands.add_parser("status", help="a running sidecar's metrics, as a table")
    status.add_argument("--metrics-url", default="http://127.0.0.1:9400/metrics",
                        help="the sidecar's metrics endpoint (metrics.listen)")
    status.add_argument("--watch", action="store_true", help="refresh in place until ^C")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    status.add_argument("--count", type=int, default=0,
                        help="with --watch: stop after this many refreshes (0: never)")

    from pipeline.app.explain import add_explain_arguments

    add_explain_arguments(commands.add_parser(
        "explain", help="why a prompt hits or misses, block by block"))

    graph = commands.add_parser("graph", help="the stage graph a config wires, as a table")
    graph.add_argument("--config", help="YAML config (default: built-in defaults)")

    config_cmd = commands.add_parser(
        "config", help="the effective config: every value, where it came from, and what "
                       "is derived from it")
    config_cmd.add_argument("--config", help="YAML config (default: built-in defaults)")
    config_cmd.add_argument("--json", action="store_true", help="print it as JSON")
    config_cmd.add_argument("--all", action="store_true",
                            help="also every constant of the effective tree")
    config_cmd.add_argument("--reference", action="store_true",
                            help="print the configuration reference (Markdown) and exit")

    bench = commands.add_parser("bench", help="the benchmark suite, into a report with plots")
    bench.add_argument("--quick", action="store_true", help="a smaller suite (minutes)")
    bench.add_argument("--out", type=Path, default=Path("bench-results"))
    bench.add_argument("--config", type=Path, default=None,
                       help="sidecar YAML config (default: configs/default.yaml)")

    from pipeline.app.disk import add_disk_arguments

    add_disk_arguments(commands.add_parser(
        "disk", help="what a disk tier holds (show), or empty it (clear); not while a "
                     "sidecar holds it"))
    keygen = commands.add_parser("keygen", help="write a CURVE key pair (sidecar or engine)")
    keygen.add_argument("--out", required=True, help="writes OUT.key (secret) and OUT.key.pub")
    return parser


def keygen(prefix: str) -> None:
    """Write a new CURVE key pair: ``prefix.key`` (secret, owner-only) and ``prefix.key.pub``."""
    import zmq

    public, secret = zmq.curve_keypair()
    for path, key, mode in ((f"{prefix}.key", secret, 0o600), (f"{prefix}.key.pub", public, 0o644)):
        try:
            # O_EXCL: never overwrite a key, and the secret is never readable by others.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except OSError as exc:
            raise KVSidecarError(f"cannot write {path}: {exc.strerror}") from exc
        with os.fdopen(fd, "wb") as file:
            file.write(key + b"\n")
        print(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            process.before_imports()
            loaded = read_config(args.config, endpoint=args.endpoint,
                                 test_config=args.test_config)
            configure_logging(loaded.config.logging)
            for note in loaded.notes:
                structlog.get_logger().warning("config.deprecated", note=note)
            anyio.run(serve, loaded.config)
            return EXIT_OK
        if args.command == "demo":
            from pipeline.app.demo import run_demo

            return run_demo(args)
        if args.command == "status":
            from pipeline.app.status import show_status

            with contextlib.suppress(KeyboardInterrupt):
                show_status(args.metrics_url, watch=args.watch, interval_s=args.interval,
                            count=args.count)
            return EXIT_OK
        if args.command == "explain":
            from pipeline.app.explain import run_explain

            return run_explain(args)
        if args.command == "disk":
            from pipeline.app.disk import run_disk

            return run_disk(args)
        if args.command == "graph":
            from pipeline.app.graph import show_graph

            show_graph(load_config(args.config))
            return EXIT_OK
        if args.command == "config":
            from pipeline.app.show_config import reference, show_config

            if args.reference:
                print(reference(), end="")
            else:
                show_config(args.config, as_json=args.json, everything=args.all)
            return EXIT_OK
        if args.command == "bench":
            from pipeline.app.bench import run_bench

            return run_bench(quick=args.quick, out=args.out, config=args.config)
        if args.command == "keygen":
            keygen(args.out)
            return EXIT_OK
        from pipeline.app.engine_sim import run_engine_sim

        return run_engine_sim(args)
    except BaseException as exc:
        error = _our_error(exc)
        if error is None:
            raise
        if isinstance(error, ConfigError):
            print(f"kvsidecar: configuration error: {error}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"kvsidecar: {error}", file=sys.stderr)
        return EXIT_FAILURE


def _our_error(exc: BaseException) -> KVSidecarError | None:
    """The one KVSidecarError behind ``exc``, through task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, KVSidecarError) else None


if __name__ == "__main__":
    sys.exit(main())

"""Lookup round-trip latency through a real sidecar against a bare ZMQ round trip.

The sidecar is started as ``python -m pipeline.app.cli serve`` on the embedded store; the
engine (this process) calls ``EngineClient.lookup`` on realistic prompts, all of whose
blocks are stored (hit) or none (miss). The baseline, measured in the same run and
interleaved with it, is a bare DEALER -> ROUTER -> DEALER round trip on the same kind of
endpoint (ipc://, another process, the same asyncio client socket type), carrying the
same msgpack-encoded Lookup frame (``lookup_message``, as the client builds it: with the
engine's hashes, only the prompt's first block and its length) and answered with a frame
the size of a LookupReply.
The in-process time to hash the prompt (pipeline.core.hashing.block_hashes, what the sidecar
must do on each lookup) is shown alongside, for attribution.

The engine's client polls for a lookup's reply for up to ``lookup_spin_s`` before it
sleeps on the socket (a thread woken from a sleep costs more the longer it slept). Each
case is also measured both ways round: the client sleeping at once (``lookup_spin_s=0``)
and a bare round trip that polls as the client does; the goals are judged against the
bare round trip as ZMQ makes it (sleeping), the like-for-like ratios printed beside.
With the engine's hashes, lookups are also made as vLLM's scheduler makes them through
the connector, from a thread without an event loop: with ``InlineLookupClient`` (the
connector's) and through a portal thread (``BlockingEngineClient``).

    python benchmarks/bench_lookup_latency.py [--tokens 1024 4096 8192] [--calls 100]
        [--repeat 5] [--config configs/default.yaml] [--profile {cprofile,py-spy}]

Goals: with engine hashes, sidecar p50 <= 2x the bare p50; tokens only, sidecar p50 <=
1.3x (bare p50 + the bare hash p50). Each figure is the median over ``--repeat``
repetitions of that repetition's p50 / p99 over ``--calls`` calls. Results are also
written to benchmarks/results/bench_lookup_latency.json.
"""

from __future__ import annotations

import os

# Idle OpenMP threads must not spin: on a small machine the sidecar's spinning copy
# threads steal the cores the engine's baseline copy runs on, and the engine's steal
# the sidecar's, so neither side would be measured fairly. Set before torch loads
# OpenMP; the sidecar process inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import zmq
import zmq.asyncio
from harness import (
    DEFAULT_CONFIG,
    ROOT,
    median,
    percentile,
    profile_path,
    spawned_sidecar,
    write_results,
)

from pipeline.core.hashing import block_hashes
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import LookupReply, encode
from transport.client import (
    LOOKUP_SPIN_S,
    BlockingEngineClient,
    EngineClient,
    InlineLookupClient,
    lookup_message,
)
from transport.sockets import FastSocket
from transport.tensors import shared_kv_caches

GOAL_ENGINE_HASHES = 2.0
"""Sidecar p50 over the bare round trip, when the engine sends its block hashes."""
GOAL_TOKENS_ONLY = 1.3
"""Sidecar p50 over (bare round trip + a bare hash of the same tokens), tokens only."""
BLOCK_SIZE = 16
LAYERS = 4
PAGE_BYTES = 16 * 1024

# A ROUTER that answers every frame at once with a fixed reply: the least a server can do.
ECHO_SERVER = """
import sys, zmq
context = zmq.Context()
socket = context.socket(zmq.ROUTER)
socket.setsockopt(zmq.LINGER, 0)
socket.bind(sys.argv[1])
reply = bytes.fromhex(sys.argv[2])
while True:
    identity, _frame = socket.recv_multipart()
    socket.send_multipart([identity, reply])
"""


@contextlib.contextmanager
def spawned_echo_server(reply: bytes) -> Iterator[str]:
    workdir = Path(tempfile.mkdtemp(prefix="kvsidecar-echo-"))
    sock = workdir / "echo.sock"
    endpoint = f"ipc://{sock}"
    process = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, endpoint, reply.hex()])
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("echo server did not start")
            time.sleep(0.02)
        yield endpoint
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        with contextlib.suppress(OSError):
            sock.unlink()
            workdir.rmdir()


async def sample(call: Callable[[], Awaitable[Any]], calls: int) -> list[float]:
    """Seconds of each of ``calls`` sequential calls."""
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)
    return out


def threaded(start_lookup: Callable[..., Any], prompt: list[int], hashes: list[bytes],
             calls: int) -> list[float]:
    """Seconds of each of ``calls`` lookups with the engine's hashes, each started and
    its result waited for, in this thread (one without an event loop)."""
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        start_lookup(prompt, block_hashes=hashes).result(timeout=30)
        out.append(time.perf_counter() - started)
    return out


async def measure(args: argparse.Namespace, sidecar: str, echo: str) -> list[dict[str, Any]]:
    layout = {"model": "bench/lookup", "groups": [{
        "kind": "full_attention", "block_size": BLOCK_SIZE, "dtype": "bfloat16",
        "page_bytes": PAGE_BYTES, "layers": [f"layers.{i}" for i in range(LAYERS)],
    }]}
    most_blocks = max(args.tokens) // BLOCK_SIZE
    kv_caches = shared_kv_caches(KVCacheLayout.from_dict(layout), most_blocks + 1)
    context = zmq.asyncio.Context()
    bare = context.socket(zmq.DEALER)
    bare.setsockopt(zmq.LINGER, 0)
    bare.connect(echo)
    polling = FastSocket(context.socket(zmq.DEALER))
    polling.socket.setsockopt(zmq.LINGER, 0)
    polling.socket.connect(echo)
    cases: list[tuple[str, int, list[int]]] = []
    next_token = 1
    for tokens in args.tokens:
        for kind in ("hit", "miss"):
            cases.append((kind, tokens, list(range(next_token, next_token + tokens))))
            next_token += tokens
    results: dict[tuple[str, int], dict[str, list[float]]] = {
        (kind, tokens): {"bare_p50": [], "bare_p99": [], "sidecar_p50": [],
                         "sidecar_p99": [], "hash_p50": [], "bare_hashes_p50": [],
                         "engine_hashes_p50": [], "engine_hashes_p99": [],
                         "request_id_p50": [], "bare_polling_p50": [],
                         "bare_hashes_polling_p50": [], "sidecar_sleeping_p50": [],
                         "engine_hashes_sleeping_p50": [], "inline_p50": [], "portal_p50": []}
        for kind, tokens, _ in cases
    }
    # Every call's seconds, for the latency CDF: (case, tokens) -> series -> samples.
    frame_bytes: dict[tuple[str, int], tuple[int, int]] = {}
    """(case, tokens) -> sizes of the tokens-only frame and of the one with hashes."""
    every: dict[tuple[str, int], dict[str, list[float]]] = {
        (kind, tokens): {"bare": [], "tokens_only": [], "engine_hashes": []}
        for kind, tokens, _ in cases
    }
    try:
        async with await EngineClient.connect(sidecar, layout=layout,
                                              kv_caches=kv_caches) as client:
            for kind, tokens, prompt in cases:
                if kind == "hit":
                    blocks = tokens // BLOCK_SIZE
                    saved = await client.save(f"warm-{tokens}", prompt,
                                              [list(range(1, blocks + 1))])
                    assert saved.stored == blocks, saved
            for kind, tokens, prompt in cases:  # warm-up, and the hit rule checked
                expected = tokens - BLOCK_SIZE if kind == "hit" else 0
                hit = await client.lookup(prompt)
                assert hit == expected, (kind, tokens, hit, expected)
            inline = await anyio.to_thread.run_sync(
                lambda: InlineLookupClient(sidecar, layout=layout))
            portal = await anyio.to_thread.run_sync(
                lambda: BlockingEngineClient(sidecar, layout=layout, kv_caches={},
                                             lookup_only=True))
            for _ in range(args.repeat):
                for kind, tokens, prompt in cases:
                    # The frames exactly as the client sends them.
                    frame = encode(lookup_message(1, prompt, BLOCK_SIZE))
                    # vLLM engines already hold their block hashes and may send them.
                    hashes = block_hashes(prompt, BLOCK_SIZE)
                    hashes_frame = encode(lookup_message(1, prompt, BLOCK_SIZE,
                                                         block_hashes=hashes))
                    frame_bytes[(kind, tokens)] = (len(frame), len(hashes_frame))

                    async def bare_call(frame: bytes = frame) -> None:
                        await bare.send(frame)
                        await bare.recv()

                    async def polling_call(frame: bytes = frame) -> None:
                        await polling.send_multipart([frame])
                        await polling.recv_multipart(LOOKUP_SPIN_S)

                    async def lookups(spin_s: float, prompt: list[int] = prompt,
                                      **kwargs: Any) -> list[float]:
                        client.lookup_spin_s = spin_s
                        return await sample(lambda: client.lookup(prompt, **kwargs),
                                            args.calls)

                    # Interleaved so drift in machine load hits both alike.
                    bare_s = await sample(bare_call, args.calls)
                    side_s = await lookups(LOOKUP_SPIN_S)
                    bare_p = await sample(polling_call, args.calls)
                    side_sleep = await lookups(0.0)
                    bare_h = await sample(lambda f=hashes_frame: bare_call(f), args.calls)
                    side_h = await lookups(LOOKUP_SPIN_S, block_hashes=hashes)
                    bare_hp = await sample(lambda f=hashes_frame: polling_call(f), args.calls)
                    side_h_sleep = await lookups(0.0, block_hashes=hashes)
                    client.lookup_spin_s = LOOKUP_SPIN_S
                    # As the connector's scheduler: started, then its result waited for.
                    side_i = await anyio.to_thread.run_sync(
                        threaded, inline.start_lookup, prompt, hashes, args.calls)
                    side_p = await anyio.to_thread.run_sync(
                        threaded, portal.start_lookup, prompt, hashes, args.calls)
                    # A request waiting to be scheduled is looked up again under its id.
                    side_r = await sample(
                        lambda p=prompt, r=f"{kind}-{tokens}": client.lookup(p, request_id=r),
                        args.calls)
                    hash_s = []
                    for _ in range(max(5, args.calls // 10)):
                        started = time.perf_counter()
                        block_hashes(prompt[: tokens - 1], BLOCK_SIZE)
                        hash_s.append(time.perf_counter() - started)
                    series = every[(kind, tokens)]
                    series["bare"].extend(bare_s)
                    series["tokens_only"].extend(side_s)
                    series["engine_hashes"].extend(side_h)
                    row = results[(kind, tokens)]
                    row["bare_p50"].append(percentile(bare_s, 0.5))
                    row["bare_p99"].append(percentile(bare_s, 0.99))
                    row["sidecar_p50"].append(percentile(side_s, 0.5))
                    row["sidecar_p99"].append(percentile(side_s, 0.99))
                    row["hash_p50"].append(percentile(hash_s, 0.5))
                    row["bare_hashes_p50"].append(percentile(bare_h, 0.5))
                    row["engine_hashes_p50"].append(percentile(side_h, 0.5))
                    row["engine_hashes_p99"].append(percentile(side_h, 0.99))
                    row["request_id_p50"].append(percentile(side_r, 0.5))
                    row["bare_polling_p50"].append(percentile(bare_p, 0.5))
                    row["bare_hashes_polling_p50"].append(percentile(bare_hp, 0.5))
                    row["sidecar_sleeping_p50"].append(percentile(side_sleep, 0.5))
                    row["engine_hashes_sleeping_p50"].append(percentile(side_h_sleep, 0.5))
                    row["inline_p50"].append(percentile(side_i, 0.5))
                    row["portal_p50"].append(percentile(side_p, 0.5))
            await anyio.to_thread.run_sync(inline.close)
            await anyio.to_thread.run_sync(portal.close)
    finally:
        bare.close(0)
        polling.close()
        polling.socket.close(0)
        context.term()
    rows = []
    for (kind, tokens), samples in results.items():
        us = {name: median(values) * 1e6 for name, values in samples.items()}
        rows.append({"case": kind, "tokens": tokens, "us": us,
                     "ratio_p50": us["sidecar_p50"] / (us["bare_p50"] + us["hash_p50"]),
                     "ratio_engine_hashes_p50": us["engine_hashes_p50"] / us["bare_hashes_p50"],
                     "ratio_request_id_p50": us["request_id_p50"] / us["bare_p50"],
                     # Like for like: both polling, and both sleeping.
                     "ratio_polling_p50": us["sidecar_p50"] / (us["bare_polling_p50"]
                                                              + us["hash_p50"]),
                     "ratio_sleeping_p50": us["sidecar_sleeping_p50"] / (us["bare_p50"]
                                                                        + us["hash_p50"]),
                     "ratio_engine_hashes_polling_p50": (us["engine_hashes_p50"]
                                                         / us["bare_hashes_polling_p50"]),
                     "ratio_engine_hashes_sleeping_p50": (us["engine_hashes_sleeping_p50"]
                                                          / us["bare_hashes_p50"]),
                     "ratio_inline_p50": us["inline_p50"] / us["bare_hashes_p50"],
                     "ratio_portal_p50": us["portal_p50"] / us["bare_hashes_p50"],
                     "frame_bytes": frame_bytes[(kind, tokens)][0],
                     "hashes_frame_bytes": frame_bytes[(kind, tokens)][1],
                     "samples_s": samples, "calls_s": every[(kind, tokens)]})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--calls", type=int, default=100, help="lookups per case and repetition")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--profile", choices=["cprofile", "py-spy"], default="")
    args = parser.parse_args(argv)

    profile_out = profile_path("bench_lookup_latency", args.profile)
    print(f"{BLOCK_SIZE}-token blocks; p50/p99 over {args.calls} calls, median of "
          f"{args.repeat}; config {args.config.name}"
          f"{'; profiled: ' + args.profile if args.profile else ''}")
    reply = encode(LookupReply(1, max(args.tokens)))
    with spawned_echo_server(reply) as echo, \
         spawned_sidecar(args.config, profile=args.profile, profile_out=profile_out) as sidecar:
        rows = anyio.run(measure, args, sidecar.endpoint, echo)

    print(f"{'case':>5} {'tokens':>6} {'frame B':>8} {'bare p50':>9} {'bare p99':>9} "
          f"{'sidecar p50':>12} {'sidecar p99':>12} {'hash p50':>9} {'ratio':>6} "
          f"{'w/ engine hashes: frame B':>26} {'bare p50':>9} {'sidecar p50':>12} {'ratio':>6} "
          f"{'repeat w/ request_id p50':>25} {'ratio':>6}   (µs)")
    worst = worst_hashes = worst_request = 0.0
    for row in rows:
        us = row["us"]
        worst = max(worst, row["ratio_p50"])
        worst_hashes = max(worst_hashes, row["ratio_engine_hashes_p50"])
        worst_request = max(worst_request, row["ratio_request_id_p50"])
        print(f"{row['case']:>5} {row['tokens']:>6} {row['frame_bytes']:>8} "
              f"{us['bare_p50']:>9.0f} {us['bare_p99']:>9.0f} {us['sidecar_p50']:>12.0f} "
              f"{us['sidecar_p99']:>12.0f} {us['hash_p50']:>9.0f} {row['ratio_p50']:>6.2f} "
              f"{row['hashes_frame_bytes']:>26} {us['bare_hashes_p50']:>9.0f} "
              f"{us['engine_hashes_p50']:>12.0f} "
              f"{row['ratio_engine_hashes_p50']:>6.2f} {us['request_id_p50']:>25.0f} "
              f"{row['ratio_request_id_p50']:>6.2f}")
    print("ratios: tokens only over (bare + hash); engine hashes and request_id over bare")
    print(f"\nlike for like: the client polling {LOOKUP_SPIN_S * 1e6:.0f} µs against a bare "
          "round trip polling so; the client sleeping at once against the bare one")
    print(f"{'case':>5} {'tokens':>6} {'bare polling':>13} {'tokens only':>12} {'ratio':>6} "
          f"{'sleeping':>9} {'ratio':>6} {'bare polling':>13} {'engine hashes':>14} "
          f"{'ratio':>6} {'sleeping':>9} {'ratio':>6}   (p50 µs)")
    for row in rows:
        us = row["us"]
        print(f"{row['case']:>5} {row['tokens']:>6} {us['bare_polling_p50']:>13.0f} "
              f"{us['sidecar_p50']:>12.0f} {row['ratio_polling_p50']:>6.2f} "
              f"{us['sidecar_sleeping_p50']:>9.0f} {row['ratio_sleeping_p50']:>6.2f} "
              f"{us['bare_hashes_polling_p50']:>13.0f} {us['engine_hashes_p50']:>14.0f} "
              f"{row['ratio_engine_hashes_polling_p50']:>6.2f} "
              f"{us['engine_hashes_sleeping_p50']:>9.0f} "
              f"{row['ratio_engine_hashes_sleeping_p50']:>6.2f}")
    print("\nengine hashes as vLLM's scheduler asks, from a thread without an event loop: "
          "the connector's InlineLookupClient, and through a portal thread")
    print(f"{'case':>5} {'tokens':>6} {'bare p50':>9} {'inline p50':>11} {'ratio':>6} "
          f"{'portal p50':>11} {'ratio':>6}   (µs)")
    for row in rows:
        us = row["us"]
        print(f"{row['case']:>5} {row['tokens']:>6} {us['bare_hashes_p50']:>9.0f} "
              f"{us['inline_p50']:>11.0f} {row['ratio_inline_p50']:>6.2f} "
              f"{us['portal_p50']:>11.0f} {row['ratio_portal_p50']:>6.2f}")
    print()
    met = True
    for name, ratio, goal in (("tokens only", worst, GOAL_TOKENS_ONLY),
                              ("engine hashes", worst_hashes, GOAL_ENGINE_HASHES)):
        met = met and ratio <= goal
        verdict = "meets" if ratio <= goal else "misses"
        print(f"{name}: worst p50 ratio {ratio:.2f} {verdict} the goal of {goal}")
    print(f"repeat with request_id: worst p50 ratio {worst_request:.2f} (no goal of its own)")
    path = write_results("bench_lookup_latency", {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "goal_tokens_only": GOAL_TOKENS_ONLY, "goal_engine_hashes": GOAL_ENGINE_HASHES,
        "worst_ratio": worst, "worst_ratio_engine_hashes": worst_hashes,
        "worst_ratio_request_id": worst_request,
        "rows": rows,
        "profile": str(profile_out.name) if profile_out else None,
    })
    print(f"results: {path.relative_to(ROOT)}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

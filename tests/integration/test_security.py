"""Security: CURVE authentication per engine key, endpoint rules, socket modes, tenants,
and no pickle anywhere on the wire. Real sidecar processes, real sockets."""

from __future__ import annotations

import ast
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import zmq

import pipeline
import pipeline.core.messages
import stages
import transport
import transport.client
from pipeline.app.cli import main as cli_main
from pipeline.core.config import ServerConfig
from pipeline.core.errors import ConfigError, RequestRejected, TransportError
from pipeline.core.tenancy import Tenancy
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import KVEngine, hybrid_layout, random_tokens
from transport.client import EngineClient
from transport.server import load_key_pair, load_public_key, open_server_socket
from transport.vllm.config import ConnectorConfig

SINGLE = Tenancy({}, ())

TIMEOUT = 20
REFUSED_TIMEOUT_S = 1.0
BLOCKS = [[1, 2, 3], [4], [1, 2, 3]]


@dataclass(frozen=True)
class Keys:
    secret_key_file: Path
    allowed_keys_file: Path
    server_public: bytes
    engine: tuple[bytes, bytes]
    stranger: tuple[bytes, bytes]

    def server_overrides(self, endpoint: str) -> dict[str, Any]:
        return {"server": {
            "endpoint": endpoint,
            "curve_secret_key_file": str(self.secret_key_file),
            "curve_allowed_keys_file": str(self.allowed_keys_file),
        }}


def _make_keys(directory: Path) -> Keys:
    assert cli_main(["keygen", "--out", str(directory / "sidecar")]) == 0
    assert cli_main(["keygen", "--out", str(directory / "engine")]) == 0
    allowed = directory / "allowed_engines"
    engine_public = (directory / "engine.key.pub").read_text().strip()
    allowed.write_text(f"# engines allowed to connect\n\n{engine_public}  # engine-a\n")
    stranger_public, stranger_secret = zmq.curve_keypair()
    return Keys(
        secret_key_file=directory / "sidecar.key",
        allowed_keys_file=allowed,
        server_public=(directory / "sidecar.key.pub").read_bytes(),  # newline and all
        engine=load_key_pair(directory / "engine.key"),
        stranger=(stranger_public, stranger_secret),
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    return _make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module", params=["tcp", "ipc"])
def curve_sidecar(
    request: pytest.FixtureRequest, keys: Keys, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SidecarProcess]:
    if request.param == "tcp":
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
    else:
        endpoint = f"ipc://{tmp_path_factory.mktemp('ipc')}/curve.sock"
    with run_sidecar_process(keys.server_overrides(endpoint)) as process:
        yield process


@pytest.fixture(scope="module")
def plain_sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process() as process:
        yield process


async def test_allowed_engine_saves_and_loads_over_curve(
    curve_sidecar: SidecarProcess, keys: Keys
) -> None:
    """An engine whose public key is listed registers, saves and loads through CURVE (on
    ipc://: over tcp it may look up, but shares no CPU memory)."""
    layout = hybrid_layout()
    if curve_sidecar.endpoint.startswith("tcp://"):
        await _looks_up_but_shares_no_cpu_memory(curve_sidecar.endpoint, keys)
        return
    a, b = KVEngine(layout), KVEngine(layout)
    tokens = random_tokens(3 * 16 + 1, seed=21)
    curve = {"curve_server_key": keys.server_public, "curve_key_pair": keys.engine}
    with anyio.fail_after(TIMEOUT):
        async with await a.connect(curve_sidecar.endpoint, **curve) as ca, \
                await b.connect(curve_sidecar.endpoint, **curve) as cb:
            assert (await ca.save("r", tokens, BLOCKS)).stored == 6
            assert await cb.lookup(tokens) == 48
            loaded = await cb.load("r", tokens, [[11, 12, 13], [9], [21, 22, 23]], 48)
    assert loaded.loaded_tokens == 48 and loaded.invalid_block_ids == ()
    assert all(a.same_block(0, 1 + i, b, 11 + i) for i in range(3))


@pytest.mark.parametrize("who", ["unlisted key", "no CURVE", "wrong server key"])
async def test_engine_without_an_allowed_key_is_refused(
    curve_sidecar: SidecarProcess, keys: Keys, who: str
) -> None:
    """An engine with an unlisted key, without CURVE, or expecting another sidecar's key
    never reaches the sidecar: it times out, told that authentication may be why."""
    engine_id = f"intruder-{who.replace(' ', '-')}"
    curve: dict[str, Any] = {
        "unlisted key": {"curve_server_key": keys.server_public, "curve_key_pair": keys.stranger},
        "no CURVE": {},
        "wrong server key": {"curve_server_key": keys.stranger[0], "curve_key_pair": keys.engine},
    }[who]
    engine = KVEngine(hybrid_layout())
    with anyio.fail_after(TIMEOUT), pytest.raises(TransportError) as refused:
        await engine.connect(curve_sidecar.endpoint, engine_id=engine_id,
                             timeout_s=REFUSED_TIMEOUT_S, **curve)
    assert ("authentication" in str(refused.value)) == bool(curve)
    log = curve_sidecar.log()
    assert engine_id not in log
    if who == "unlisted key":
        assert "server.auth.refused" in log and keys.stranger[0].decode() in log


async def test_non_loopback_tcp_starts_with_curve(keys: Keys) -> None:
    """tcp:// on all interfaces starts without allow_insecure_tcp when CURVE is on."""
    port = _free_port()
    engine = KVEngine(hybrid_layout())
    with run_sidecar_process(keys.server_overrides(f"tcp://0.0.0.0:{port}")):
        with anyio.fail_after(TIMEOUT):
            async with await EngineClient.connect(
                f"tcp://127.0.0.1:{port}", layout=engine.layout, kv_caches={},
                lookup_only=True, curve_server_key=keys.server_public,
                curve_key_pair=keys.engine,
            ) as client:
                assert await client.lookup(random_tokens(40)) == 0


async def _looks_up_but_shares_no_cpu_memory(endpoint: str, keys: Keys) -> None:
    """A tcp peer's lookup-only session serves; its CPU memory is refused by name."""
    engine = KVEngine(hybrid_layout())
    curve = {"curve_server_key": keys.server_public, "curve_key_pair": keys.engine}
    with anyio.fail_after(TIMEOUT):
        async with await EngineClient.connect(endpoint, layout=engine.layout, kv_caches={},
                                              lookup_only=True, **curve) as client:
            assert await client.lookup(random_tokens(40)) == 0
        with pytest.raises(RequestRejected, match="not ipc://"):
            await engine.connect(endpoint, **curve)


def test_non_loopback_tcp_without_curve_or_opt_in_is_refused() -> None:
    """Without CURVE or allow_insecure_tcp, a non-loopback tcp:// endpoint is not bound,
    and the error names both ways out."""
    with pytest.raises(TransportError) as refused:
        open_server_socket(ServerConfig(endpoint=f"tcp://0.0.0.0:{_free_port()}"), SINGLE)
    assert "curve_secret_key_file" in str(refused.value)
    assert "allow_insecure_tcp" in str(refused.value)


@pytest.mark.parametrize("which, content", [
    ("secret", None),
    ("secret", "not a key at all\n"),
    ("secret", "abcde\n"),
    ("secret", "# no key here\n"),
    ("allowed", None),
    ("allowed", "# nobody\n"),
    ("allowed", "# one bad key\n" + "~" * 40 + "\n"),
])
def test_unreadable_or_invalid_key_file_is_a_config_error_naming_it(
    tmp_path: Path, keys: Keys, which: str, content: str | None
) -> None:
    """A missing key file, one without a valid Z85 key, or an empty allow list is a
    ConfigError naming the config key and the file; nothing is bound."""
    bad = tmp_path / f"bad-{which}"
    if content is not None:
        bad.write_text(content)
    files = {"secret": str(keys.secret_key_file), "allowed": str(keys.allowed_keys_file),
             which: str(bad)}
    config = ServerConfig(
        endpoint=f"ipc://{tmp_path}/never.sock",
        curve_secret_key_file=files["secret"],
        curve_allowed_keys_file=files["allowed"],
    )
    with pytest.raises(ConfigError) as error:
        open_server_socket(config, SINGLE)
    assert str(bad) in str(error.value)
    assert f"server.curve_{which}_" in str(error.value)
    assert not (tmp_path / "never.sock").exists()


def test_serve_with_a_missing_key_file_fails_naming_it(tmp_path: Path, keys: Keys) -> None:
    """`kvsidecar serve` stops at start-up with exit code 2, naming the key and the file,
    when a key file is missing."""
    missing = tmp_path / "missing.key"
    overrides = keys.server_overrides(f"ipc://{tmp_path}/s.sock")
    overrides["server"]["curve_secret_key_file"] = str(missing)
    with pytest.raises(RuntimeError, match="sidecar exited with 2") as failed:
        with run_sidecar_process(overrides):
            pass
    assert (
        f"configuration error: server.curve_secret_key_file: cannot read CURVE key file {missing}"
        in str(failed.value)
    )


def test_curve_files_must_be_set_together() -> None:
    """A secret key without an allow list (or the reverse) is refused at config load."""
    with pytest.raises(ValueError, match="set together"):
        ServerConfig(curve_secret_key_file="sidecar.key")
    with pytest.raises(ValueError, match="set together"):
        ServerConfig(curve_allowed_keys_file="allowed")


async def test_client_refuses_half_or_invalid_curve_settings(keys: Keys) -> None:
    """A server key without a key pair, or a malformed key, is a ConfigError at connect."""
    engine = KVEngine(hybrid_layout(), num_blocks=4)
    with anyio.fail_after(TIMEOUT):
        with pytest.raises(ConfigError, match="together"):
            await engine.connect("ipc:///nonexistent", curve_server_key=keys.server_public)
        with pytest.raises(ConfigError, match="invalid CURVE key"):
            await engine.connect("ipc:///nonexistent", curve_server_key="short",
                                 curve_key_pair=keys.engine)


def test_a_public_key_file_reads_like_the_other_key_files(
    tmp_path: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """keygen's .key.pub loads as the one key it holds, also as the vLLM connector reads
    its keys; `kvsidecar explain` given a missing one stops with exit code 2 naming the
    file, before it connects anywhere."""
    public_file = keys.secret_key_file.with_suffix(".key.pub")
    assert load_public_key(public_file) == keys.server_public.strip()
    connector = ConnectorConfig(endpoint="ipc:///unused", curve_server_key_file=str(public_file),
                                curve_key_file=str(public_file.parent / "engine.key"))
    assert connector.curve() == {"curve_server_key": keys.server_public.strip(),
                                 "curve_key_pair": keys.engine}
    missing = tmp_path / "missing.key.pub"
    code = cli_main(["explain", "--endpoint", f"ipc://{tmp_path}/none.sock", "--tokens", "1,2",
                     "--curve-server-key-file", str(missing),
                     "--curve-key-file", str(keys.secret_key_file)])
    assert code == 2
    assert f"cannot read CURVE key file {missing}" in capsys.readouterr().err


def test_keygen_secret_is_owner_only_and_matches_its_public_key(tmp_path: Path) -> None:
    """`kvsidecar keygen` writes a 0600 secret key and its public key, and never
    overwrites an existing key."""
    prefix = tmp_path / "node"
    assert cli_main(["keygen", "--out", str(prefix)]) == 0
    secret_file = Path(f"{prefix}.key")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    public, secret = load_key_pair(secret_file)
    assert Path(f"{prefix}.key.pub").read_text().strip().encode() == public
    assert zmq.curve_public(secret) == public
    assert cli_main(["keygen", "--out", str(prefix)]) == 1
    assert load_key_pair(secret_file) == (public, secret)


def test_ipc_socket_file_is_owner_only(plain_sidecar: SidecarProcess) -> None:
    """A running sidecar's ipc:// socket file is a socket with mode 0600."""
    mode = os.stat(plain_sidecar.endpoint.removeprefix("ipc://")).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


async def test_cache_prefix_separates_tenants(plain_sidecar: SidecarProcess) -> None:
    """Engines whose layouts differ only in cache_prefix never see each other's blocks;
    the same cache_prefix hits."""
    a = KVEngine(hybrid_layout(cache_prefix="tenant-a"))
    b = KVEngine(hybrid_layout(cache_prefix="tenant-b"))
    a2 = KVEngine(hybrid_layout(cache_prefix="tenant-a"))
    tokens = random_tokens(3 * 16 + 1, seed=31)
    target = [[11, 12, 13], [9], [21, 22, 23]]
    b_before = [b.pages(0, block) for block in target[0]]
    with anyio.fail_after(TIMEOUT):
        async with await a.connect(plain_sidecar.endpoint) as ca, \
                await b.connect(plain_sidecar.endpoint) as cb, \
                await a2.connect(plain_sidecar.endpoint) as ca2:
            assert (await ca.save("r", tokens, BLOCKS)).stored == 6
            assert await cb.lookup(tokens) == 0
            denied = await cb.load("r", tokens, target, 48)
            assert await ca2.lookup(tokens) == 48
            allowed = await ca2.load("r", tokens, target, 48)
    assert denied.loaded_tokens == 0
    for block, before in zip(target[0], b_before, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(b.pages(0, block), before, strict=True))
    assert allowed.loaded_tokens == 48 and allowed.invalid_block_ids == ()
    assert all(a.same_block(0, 1 + i, a2, 11 + i) for i in range(3))


FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
FORBIDDEN_NAMES = {"send_pyobj", "recv_pyobj", "Unpickler", "Pickler"}
OTHER_CODECS = {"json", "msgpack", "cbor2", "orjson", "ujson", "simplejson", "yaml", "bson",
                "google", "protobuf", *FORBIDDEN_MODULES}


def _sources(*packages: Any) -> Iterator[tuple[Path, ast.Module]]:
    for package in packages:
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_or_uses_pickle() -> None:
    """No module of pipeline/, stages/ or transport/ imports pickle (or a relative), calls
    pyzmq's pickling send/recv, or loads torch's pickled files."""
    offenders = []
    for path, tree in _sources(pipeline, stages, transport):
        offenders += [f"{path}: import {name}" for name in _imports(tree) & FORBIDDEN_MODULES]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
                offenders.append(f"{path}:{node.lineno}: .{node.attr}")
            if (isinstance(node, ast.Attribute) and node.attr in {"load", "save"}
                    and isinstance(node.value, ast.Name) and node.value.id == "torch"):
                offenders.append(f"{path}:{node.lineno}: torch.{node.attr}")
            if isinstance(node, ast.Constant) and node.value in FORBIDDEN_MODULES:
                offenders.append(f"{path}:{node.lineno}: {node.value!r}")  # __import__ et al.
    assert offenders == []


def test_msgspec_is_the_only_wire_codec_in_transport() -> None:
    """transport/ imports no serializer but msgspec, and the client speaks the typed
    msgspec msgpack codec of pipeline.core.messages."""
    for path, tree in _sources(transport):
        assert not _imports(tree) & OTHER_CODECS, path
    client_namespace = vars(transport.client)
    assert client_namespace["encode"] is pipeline.core.messages.encode
    decoder = pipeline.core.messages.decode_sidecar_message
    assert client_namespace["decode_sidecar_message"] is decoder
    messages_tree = ast.parse(Path(pipeline.core.messages.__file__).read_text())
    assert _imports(messages_tree) & OTHER_CODECS == set()
    assert "msgspec" in _imports(messages_tree)

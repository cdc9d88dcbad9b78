"""Config: every shipped YAML loads; bad keys and values are ConfigErrors naming their path."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from pipeline.app.cli import main
from pipeline.core.config import (
    Config,
    ConfigError,
    OperatorConfig,
    default_endpoint,
    load_config,
    read_config,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SHIPPED = sorted(
    path for path in CONFIGS.rglob("*.yaml") if (CONFIGS / "layouts") not in path.parents
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return str(info.value)


# -- shipped files -----------------------------------------------------------------------------


def test_configs_directory_ships_a_default() -> None:
    """configs/default.yaml exists, so the parametrized load below is never empty."""
    assert CONFIGS / "default.yaml" in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_loads(path: Path) -> None:
    """Each YAML under configs/ (layout presets aside) is a valid sidecar config."""
    assert isinstance(load_config(path), Config)


def test_default_yaml_reads_octal_permissions_and_the_embedded_store() -> None:
    """default.yaml's `0600` is the octal owner-only mode, and it selects the embedded store."""
    config = load_config(CONFIGS / "default.yaml")
    assert config.server.ipc_permissions == 0o600
    assert config.store.backend == "embedded"
    assert config.server.endpoint == default_endpoint()


def test_default_yaml_holds_every_default_and_nothing_else() -> None:
    """default.yaml is "every operator key, with its default": a sidecar started without
    a config runs exactly as one started with it, and it needs no migration."""
    loaded = read_config(CONFIGS / "default.yaml")
    assert loaded.config == load_config()
    assert not loaded.notes


# -- defaults and overrides --------------------------------------------------------------------


def test_no_path_and_an_empty_file_give_defaults(tmp_path: Path) -> None:
    """Without a file, or with an empty one, every value is its default."""
    assert load_config(write(tmp_path, "\n")) == load_config()
    assert read_config(write(tmp_path, "\n")).operator == OperatorConfig()


def test_endpoint_override_replaces_only_the_endpoint(tmp_path: Path) -> None:
    """--endpoint replaces server.endpoint and keeps the file's other server settings."""
    path = write(tmp_path, "server:\n  endpoint: ipc:///tmp/a.sock\n  rcvhwm: 7\n")
    config = load_config(path, endpoint="tcp://127.0.0.1:5555")
    assert config.server.endpoint == "tcp://127.0.0.1:5555"
    assert config.server.rcvhwm == 7
    assert load_config(path).server.endpoint == "ipc:///tmp/a.sock"
    assert load_config(endpoint="ipc:///tmp/b.sock").server.endpoint == "ipc:///tmp/b.sock"


def test_default_endpoint_lives_in_the_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ipc endpoint is a socket in the sidecar's own directory: under
    XDG_RUNTIME_DIR, or a per-user one in /tmp."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert default_endpoint() == "ipc:///run/user/1234/kvsidecar/sidecar.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_endpoint() == f"ipc:///tmp/kvsidecar-{os.getuid()}/sidecar.sock"


def test_cli_reports_a_bad_config_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvsidecar serve --config bad.yaml --endpoint ...` exits 2 naming the key's path."""
    path = write(tmp_path, "stages:\n  transfer: {overflow: sometimes}\n")
    assert main(["serve", "--config", str(path), "--endpoint", "ipc:///tmp/x.sock"]) == 2
    assert "$.stages.transfer.overflow" in capsys.readouterr().err


# -- unknown keys ------------------------------------------------------------------------------


def _sections(struct: type, path: str = "$") -> list[tuple[str, str]]:
    """(YAML nesting, path) for every section of the config tree."""
    found = [("", path)]
    for field in msgspec.structs.fields(struct):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            for nesting, sub in _sections(field.type, f"{path}.{field.name}"):
                found.append((f"{field.name}:\n" + _indent(nesting), sub))
    return found


def _indent(text: str) -> str:
    return "".join(f"  {line}\n" for line in text.splitlines())


@pytest.mark.parametrize(("nesting", "path"), _sections(Config), ids=lambda v: v)
def test_unknown_keys_are_refused_with_their_path(tmp_path: Path, nesting: str, path: str) -> None:
    """An unknown key in any section is a ConfigError naming the key and the section path
    (fault injection, test-only, is refused as a whole)."""
    depth = nesting.count("\n")
    text = nesting + "  " * depth + "no_such_key: 1\n"
    message = config_error(tmp_path, text)
    if path.startswith("$.faults"):
        assert "--test-config" in message
        return
    assert "`no_such_key`" in message
    if path != "$":
        assert f"`{path}`" in message
    assert str(tmp_path / "config.yaml") in message


# -- bad values --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("staging:\n  pool_bytes: -1\n", "$.staging.pool_bytes"),
        ("stages:\n  hashing: {workers: 0}\n", "$.stages.hashing.workers"),
        ("stages:\n  batching: {deadline_ms: -1}\n", "$.stages.batching.deadline_ms"),
        ("stages:\n  transfer: {threads: many}\n", "$.stages.transfer.threads"),
        ("store:\n  backend: redis\n", "$.store.backend"),
        ("store:\n  mooncake: {protocol: udp}\n", "$.store.mooncake.protocol"),
        (
            "store:\n  mooncake: {global_segment_bytes: 1024}\n",
            "$.store.mooncake.global_segment_bytes",
        ),
        ("logging:\n  level: loud\n", "$.logging.level"),
        ("server: 5\n", "$.server"),
        ("server:\n  heartbeat_timeout_s: 0\n", "$.server.heartbeat_timeout_s"),
    ],
)
def test_bad_values_name_their_path(tmp_path: Path, text: str, path: str) -> None:
    """A value of the wrong type or out of range is a ConfigError with its `$.path`."""
    assert f"`{path}`" in config_error(tmp_path, text)


@pytest.mark.parametrize(
    "staging",
    [
        "{pool_bytes: 1024, slot_bytes: 1024, load_slots: 1}",  # one slot only
        "{pool_bytes: 4096, slot_bytes: 1024, load_slots: 4}",  # no slot left for saves
        "{pool_bytes: 1024, slot_bytes: 4096, load_slots: 1}",  # slot larger than the pool
    ],
)
def test_staging_that_cannot_be_cut_into_slots_is_a_config_error(
    tmp_path: Path, staging: str
) -> None:
    """A pool without a load slot and a save slot is refused at load time, naming $.staging."""
    message = config_error(tmp_path, f"staging: {staging}\n")
    assert "`$.staging`" in message and "load_slots" in message


def test_non_mapping_document_is_a_config_error(tmp_path: Path) -> None:
    """A YAML list where a mapping belongs is refused."""
    assert "Expected `object`" in config_error(tmp_path, "- 1\n- 2\n")


def test_invalid_yaml_is_a_config_error(tmp_path: Path) -> None:
    """A YAML syntax error is a ConfigError that says so."""
    assert "not valid YAML" in config_error(tmp_path, "server: [\n")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """An unreadable path is a ConfigError naming it."""
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match=r"absent\.yaml"):
        load_config(missing)


@pytest.mark.parametrize(("tenants", "problem"), [
    ("{a: {identities: ['uid:1']}, b: {identities: ['uid:1']}}", "is in tenants 'a' and 'b'"),
    ("{a: {identities: ['uid:1'], key_prefix: x}, b: {identities: ['uid:2'], key_prefix: x}}",
     "share the key prefix 'x'"),
    ("{a: {identities: ['root']}}", "is not one of 'uid:<n>'"),
    ("{a: {identities: []}}", "at least one identity"),
    ("{'a@b': {identities: ['uid:1']}}", "contain no '@'"),
])
def test_tenants_are_checked_at_load(tmp_path: Path, tenants: str, problem: str) -> None:
    """An identity in two tenants, a shared key prefix, an identity no transport proves,
    an empty tenant or an '@' in a name is a config error naming it."""
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, f"tenants: {tenants}\n"))
    assert problem in str(error.value)


def test_operators_default_to_the_sidecars_own_user() -> None:
    """Without server.operators, the sidecar's own unix user is its operator."""
    assert load_config().server.operators == (f"uid:{os.getuid()}",)

"""The operator's config surface: how many keys, their reference, the named modes, the
refusals of contradictions, and the migration of old files."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from pipeline.app.show_config import reference
from pipeline.core.config import (
    Config,
    ConfigError,
    Machine,
    OperatorConfig,
    load_config,
    operator_paths,
    read_config,
)
from pipeline.core.config.migrate import RENAMED
from pipeline.core.config.operator import TenantSection
from pipeline.core.config.resolve import GiB, MiB

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = ROOT / "docs" / "configuration.md"


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_an_operator_sets_at_most_30_keys() -> None:
    """Walking the typed operator config, every YAML-settable leaf counts once (a mapping
    of named entries counts as its entry's fields)."""

    def leaves(struct: type) -> int:
        count = 0
        for field in msgspec.structs.fields(struct):
            if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
                count += leaves(field.type)
            elif field.name == "tenants":
                count += len(msgspec.structs.fields(TenantSection))
            else:
                count += 1
        return count

    assert leaves(OperatorConfig) <= 30


def test_the_reference_is_generated_from_the_typed_config_and_names_every_key() -> None:
    """docs/configuration.md is what `kvsidecar config --reference` prints now."""
    text = REFERENCE.read_text()
    assert text == reference(), "regenerate: kvsidecar config --reference > docs/configuration.md"
    for path in operator_paths():
        key = "tenants.NAME.identities" if path == "tenants" else path
        assert f"`{key}`" in text


def test_the_shipped_default_config_names_every_operator_key() -> None:
    text = (ROOT / "configs" / "default.yaml").read_text()
    for path in operator_paths():
        assert f"{path.rsplit('.', 1)[-1]}:" in text, path


def test_on_the_reference_machine_the_constants_are_the_defaults() -> None:
    """The tree's defaults are what a 2-CPU host with 24 GiB resolves to, so a test that
    builds ``Config()`` runs what the sidecar runs there."""
    machine = Machine(cpus=2, memory_bytes=24 * GiB)
    assert read_config(machine=machine).config == Config()


@pytest.mark.parametrize(("cpus", "memory", "threads", "staging"), [
    (1, 4 * GiB, 2, 512 * MiB),
    (16, 64 * GiB, 4, 4 * GiB),
    (128, 2048 * GiB, 8, 4 * GiB),
    (8, 24 * GiB, 2, GiB),
])
def test_copy_threads_and_staging_follow_the_machine(
    cpus: int, memory: int, threads: int, staging: int
) -> None:
    config = read_config(machine=Machine(cpus=cpus, memory_bytes=memory)).config
    assert config.stages.transfer.threads == threads
    assert config.staging.pool_bytes == staging


@pytest.mark.parametrize(("mode", "receive", "transfer"), [
    ("shed_saves", "skip", "block"),
    ("shed_saves_never_wait", "skip", "skip"),
    ("backpressure", "block", "block"),
])
def test_each_overload_mode_sets_both_overflows(
    tmp_path: Path, mode: str, receive: str, transfer: str
) -> None:
    config = load_config(write(tmp_path, f"store: {{overload: {mode}}}\n"))
    assert (config.stages.receive.overflow, config.stages.transfer.overflow) == (
        receive, transfer)


@pytest.mark.parametrize(("mode", "value_format", "verify"), [
    ("native", "native", "required"),
    ("vllm", "vllm", "required"),
    ("vllm_unverified", "vllm", "if_present"),
])
def test_each_store_format_sets_the_format_and_its_check(
    tmp_path: Path, mode: str, value_format: str, verify: str
) -> None:
    config = load_config(write(tmp_path, f"store: {{format: {mode}}}\n"))
    assert (config.store.value_format, config.store.verify) == (value_format, verify)


@pytest.mark.parametrize(("old", "new", "key"), [
    ("stages: {receive: {overflow: block}}", "store: {overload: backpressure}",
     "store.overload"),
    ("stages: {receive: {overflow: skip}, transfer: {overflow: skip}}",
     "store: {overload: shed_saves_never_wait}", "store.overload"),
    ("store: {value_format: vllm, verify: if_present}", "store: {format: vllm_unverified}",
     "store.format"),
    ("stages: {transfer: {device: cuda}}", "store: {engine_memory: cuda}",
     "store.engine_memory"),
    ("store: {embedded: {capacity_bytes: 33554432}}", "store: {capacity_bytes: 33554432}",
     "store.capacity_bytes"),
    ("store: {backend: mooncake, mooncake: {global_segment_bytes: 33554432}}",
     "store: {backend: mooncake, capacity_bytes: 33554432}", "store.capacity_bytes"),
    ("store: {backend: mooncake, mooncake: {protocol: rdma, device_name: mlx5_0}}",
     "store: {backend: mooncake, mooncake: {rdma_devices: mlx5_0}}",
     "store.mooncake.rdma_devices"),
    ("metrics: {host: 127.0.0.1, port: 9400}", "metrics: {listen: '127.0.0.1:9400'}",
     "metrics.listen"),
])
def test_an_old_key_loads_as_its_replacement_with_a_note_naming_it(
    tmp_path: Path, old: str, new: str, key: str
) -> None:
    migrated = read_config(write(tmp_path, old + "\n", "old.yaml"))
    current = read_config(write(tmp_path, new + "\n", "new.yaml"))
    assert migrated.config == current.config
    assert not current.notes
    assert [note for note in migrated.notes if f"write {key}:" in note], migrated.notes


def test_every_renamed_key_has_a_migration_test() -> None:
    """RENAMED (the upgrade notes) and the parametrized migrations above cover the same
    old keys, faults aside."""
    tested = {"stages.receive.overflow", "stages.transfer.overflow",
              "store.value_format, store.verify", "stages.transfer.device",
              "store.embedded.capacity_bytes", "store.mooncake.global_segment_bytes",
              "store.mooncake.protocol, store.mooncake.device_name",
              "metrics.host, metrics.port"}
    assert set(RENAMED) - {"faults", "stages.completion"} == tested


def test_old_keys_that_are_no_longer_operator_settings_are_honoured_with_one_note(
    tmp_path: Path,
) -> None:
    loaded = read_config(write(tmp_path, "stages: {receive: {max_saves_per_engine: 2}, "
                                         "hashing: {workers: 3}}\nserver: {rcvhwm: 9}\n"))
    assert loaded.config.stages.receive.max_saves_per_engine == 2
    assert loaded.config.stages.hashing.workers == 3
    assert loaded.config.server.rcvhwm == 9
    assert len(loaded.notes) == 1
    for key in ("stages.receive.max_saves_per_engine", "stages.hashing.workers",
                "server.rcvhwm"):
        assert key in loaded.notes[0]


@pytest.mark.parametrize(("text", "keys"), [
    ("stages: {receive: {overflow: block}, transfer: {overflow: skip}}",
     ("stages.receive.overflow", "stages.transfer.overflow")),
    ("store: {mooncake: {master: 'host:50051'}}", ("store.mooncake.master", "store.backend")),
    ("events: {replay_endpoint: 'ipc:///tmp/r'}",
     ("events.replay_endpoint", "events.endpoint")),
    ("store: {overload: backpressure}\nstages: {receive: {overflow: skip}}",
     ("stages.receive.overflow", "store.overload")),
    ("store: {capacity_bytes: 33554432, embedded: {capacity_bytes: 67108864}}",
     ("store.embedded.capacity_bytes", "store.capacity_bytes")),
    ("store: {backend: mooncake, mooncake: {protocol: rdma}}",
     ("store.mooncake.protocol", "store.mooncake.device_name")),
])
def test_a_contradiction_is_refused_naming_both_keys(
    tmp_path: Path, text: str, keys: tuple[str, str]
) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, text + "\n"))
    for key in keys:
        assert key in str(refused.value)


def test_fault_injection_is_refused_in_an_operators_file_and_read_from_a_test_config(
    tmp_path: Path,
) -> None:
    faults = "faults: {points: {store.put: {error_rate: 0.5}}}\n"
    with pytest.raises(ConfigError, match="--test-config"):
        load_config(write(tmp_path, faults))
    config = load_config(None, test_config=write(tmp_path, faults, "test.yaml"))
    assert config.faults.points["store.put"].error_rate == 0.5
    quiet = read_config(write(tmp_path, "faults: {seed: 0, points: {}}\n"))
    assert quiet.config.faults.points == {} and "dropped" in quiet.notes[0]


def test_a_test_config_overrides_what_the_operators_keys_resolve_to(tmp_path: Path) -> None:
    operator = write(tmp_path, "store: {overload: backpressure}\n")
    test = write(tmp_path, "stages: {transfer: {overflow: skip, workers: 5}}\n", "t.yaml")
    config = load_config(operator, test_config=test)
    assert config.stages.receive.overflow == "block"
    assert config.stages.transfer.overflow == "skip"
    assert config.stages.transfer.workers == 5
    assert config.stages.transfer.inbox_size == 64  # the rest of the section keeps its constants


def test_a_dotted_key_is_an_unknown_field_not_a_path(tmp_path: Path) -> None:
    """``a.b: 1`` is refused by name: read as a path it would slip past the migration
    and its refusals (here the contradictory pair of overflow policies)."""
    text = "'stages.receive.overflow': block\nstore: {overload: shed_saves_never_wait}\n"
    with pytest.raises(ConfigError, match=r"unknown field `stages.receive.overflow` - at `\$`"):
        load_config(write(tmp_path, text))
    with pytest.raises(ConfigError, match=r"unknown field `receive.overflow` - at `\$.stages`"):
        load_config(write(tmp_path, "stages: {'receive.overflow': block}\n"))


def test_a_small_embedded_store_loads_and_a_small_mooncake_segment_is_refused(
    tmp_path: Path,
) -> None:
    small = 8 << 20
    config = load_config(write(tmp_path, f"store: {{embedded: {{capacity_bytes: {small}}}}}\n"))
    assert config.store.embedded.capacity_bytes == small
    with pytest.raises(ConfigError, match=r"store\.capacity_bytes"):
        load_config(write(tmp_path, f"store: {{backend: mooncake, capacity_bytes: {small}}}\n"))


def test_old_staging_slots_get_a_pool_they_fit_in_on_a_small_host(tmp_path: Path) -> None:
    """The pool is sized from the machine; slots an old file sets still fit in it."""
    path = write(tmp_path, "staging: {slot_bytes: 134217728, load_slots: 4}\n")
    config = read_config(path, machine=Machine(cpus=2, memory_bytes=8 * GiB)).config
    assert config.staging.pool_bytes >= 5 * config.staging.slot_bytes
    config = read_config(path, machine=Machine(cpus=2, memory_bytes=64 * GiB)).config
    assert config.staging.pool_bytes == 4 * GiB


def test_empty_sections_and_comments_need_no_note(tmp_path: Path) -> None:
    loaded = read_config(write(tmp_path, "server: {}\nstore: {mooncake: {}}\nlogging: {}\n"))
    assert loaded.notes == ()
    assert read_config(write(tmp_path, "# nothing but a comment\n")).config == load_config()


@pytest.mark.parametrize(("text", "path"), [
    ("metrics: {port: true}\n", "$.metrics.port"),
    ("stages: {transfer: {device: gpu}}\n", "$.store.engine_memory"),
])
def test_bad_old_values_name_a_path(tmp_path: Path, text: str, path: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"`{path}`")):
        load_config(write(tmp_path, text))


def test_a_test_config_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a test config is a mapping"):
        load_config(None, test_config=write(tmp_path, "- 1\n", "test.yaml"))

"""``kvsidecar config``'s view of a config: each operator key's value and source, the
values derived from it, and the effective tree."""

from __future__ import annotations

from pathlib import Path

import msgspec

from pipeline.app.show_config import constants, derived, operator_keys
from pipeline.core.config import Config, MooncakeStoreConfig, StoreConfig, read_config


def test_each_operator_key_says_whether_the_file_an_old_key_or_the_default_set_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("server: {max_peers: 7}\nstages: {receive: {overflow: block}}\n"
                    "store: {embedded: {capacity_bytes: 33554432}}\n")
    rows = {key: (value, source) for key, value, source in operator_keys(read_config(path))}
    assert rows["server.max_peers"] == (7, "file")
    assert rows["store.overload"] == ("backpressure", "file (stages.receive.overflow)")
    assert rows["store.capacity_bytes"] == (33554432, "file (store.embedded.capacity_bytes)")
    assert rows["store.backend"] == ("embedded", "default")
    assert sum(source != "default" for _, source in rows.values()) == 3


def test_the_effective_tree_marks_what_tuning_and_the_operator_set(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("stages: {transfer: {workers: 3}}\nstore: {format: vllm}\n")
    rows = {key: (value, source) for key, value, source in constants(read_config(path))}
    assert rows["stages.transfer.workers"] == (3, "tuning")
    assert rows["store.value_format"] == ("vllm", "resolved")
    assert rows["stages.hashing.inbox_size"] == (64, "constant")


def test_the_data_path_is_named_for_each_store_and_mode() -> None:
    def path(store: StoreConfig) -> str:
        return str(derived(msgspec.structs.replace(Config(), store=store))["data path"])

    assert path(StoreConfig()).startswith("lent")
    assert path(StoreConfig(backend="mooncake")).startswith("in place")
    assert path(StoreConfig(backend="mooncake",
                            mooncake=MooncakeStoreConfig(in_place=False))).startswith("staged")

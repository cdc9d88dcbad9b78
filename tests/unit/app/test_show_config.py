"""``kvsidecar config``'s view of a config: each leaf's value and source, and what is
derived from it."""

from __future__ import annotations

import msgspec

from pipeline.app.show_config import derived, effective
from pipeline.core.config import Config, MooncakeStoreConfig, StoreConfig


def test_every_leaf_is_listed_once_and_only_what_the_file_sets_is_from_the_file() -> None:
    written = {"stages": {"transfer": {"workers": 3}}, "server": {"max_peers": 7}}
    config = msgspec.convert(written, Config)
    rows = {key: (value, source) for key, value, source in effective(config, written)}
    assert rows["stages.transfer.workers"] == (3, "file")
    assert rows["server.max_peers"] == (7, "file")
    assert rows["stages.transfer.inbox_size"][1] == "default"
    assert [source for _, source in rows.values()].count("file") == 2
    assert len(rows) == len(list(effective(Config(), {})))


def test_the_data_path_is_named_for_each_store_and_mode() -> None:
    def path(store: StoreConfig) -> str:
        return str(derived(msgspec.structs.replace(Config(), store=store))["data path"])

    assert path(StoreConfig()).startswith("lent")
    assert path(StoreConfig(backend="mooncake")).startswith("in place")
    assert path(StoreConfig(backend="mooncake",
                            mooncake=MooncakeStoreConfig(in_place=False))).startswith("staged")

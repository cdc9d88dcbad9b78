"""Layout presets in configs/layouts load, validate and store what their comments claim."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.core.layout import KVCacheLayout

PRESETS = Path(__file__).resolve().parents[3] / "configs" / "layouts"
PRESET_FILES = sorted(PRESETS.glob("*.yaml"))


def load(name: str) -> KVCacheLayout:
    return KVCacheLayout.from_dict(yaml.safe_load((PRESETS / f"{name}.yaml").read_text()))


def test_presets_exist() -> None:
    """The documented presets are all present."""
    assert {p.stem for p in PRESET_FILES} >= {
        "llama-dense", "gemma-swa-hybrid", "deepseek-mla", "qwen3-next-hybrid",
        "qwen3-next-hybrid-mtp",
    }


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_preset_loads_and_validates_for_store(path: Path) -> None:
    """Every preset loads with the layout schema, passes store validation and maps layers."""
    lay = KVCacheLayout.from_dict(yaml.safe_load(path.read_text()))
    lay.validate_for_store()
    for group in lay.groups:
        assert group.layers and group.page_bytes > 0
    assert all(names for names in lay.payload_layers)


def test_llama_dense_preset() -> None:
    """Llama dense is one 16-token full-attention group of 32 layers."""
    lay = load("llama-dense")
    assert [(g.kind, g.block_size, len(g.layers)) for g in lay.groups] == [
        ("full_attention", 16, 32)
    ]
    assert lay.hash_block_size == 16


def test_gemma_preset_stores_both_groups() -> None:
    """Gemma's sliding-window and full groups are both stored."""
    lay = load("gemma-swa-hybrid")
    assert {g.kind for g in lay.store_groups} == {"full_attention", "sliding_window"}


def test_deepseek_preset_is_mla() -> None:
    """DeepSeek's preset is a single MLA group."""
    assert [g.kind for g in load("deepseek-mla").groups] == ["mla_attention"]


@pytest.mark.parametrize(("name", "capacity"),
                         [("qwen3-next-hybrid", 4), ("qwen3-next-hybrid-mtp", 8)])
def test_qwen3_next_presets_store_attention_and_mamba_not_the_ring(
    name: str, capacity: int
) -> None:
    """Qwen3-Next stores full attention and mamba (align) at 800 tokens; the ring is skipped."""
    lay = load(name)
    assert [g.kind for g in lay.groups] == ["full_attention", "circular_buffer", "mamba"]
    assert lay.groups[1].block_size == capacity
    assert lay.prefix_cacheable_group_ids == (0, 2)
    assert lay.hash_block_size == 800
    assert lay.store_groups[1].mamba_cache_mode == "align"
    assert not set(lay.groups[1].layers) & {n for names in lay.payload_layers for n in names}


def test_a_preset_is_found_by_name_from_any_directory_and_a_wrong_name_lists_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine simulator reads presets from the checkout whatever the working
    directory; an unknown name is refused with the presets there are."""
    from pipeline.app.engine_sim import load_layout
    from pipeline.core.errors import KVSidecarError

    monkeypatch.chdir(tmp_path)
    assert load_layout("llama-dense").groups
    with pytest.raises(KVSidecarError, match=r"no layout preset 'nope'.*llama-dense"):
        load_layout("nope")

"""The copy-engine choice at the root: CUDA copies are chosen by config, and refused at
start where torch sees no GPU, before any engine could register; what waits for their
kernels to compile holds no engine memory."""

from __future__ import annotations

import gc
import weakref

import msgspec
import pytest
import torch

from pipeline.app.backends import open_backends
from pipeline.backends.cuda_kernels import KernelForms, compile_kernels, kernel_forms
from pipeline.backends.faults import Faults
from pipeline.core.config import Config, FaultsConfig
from pipeline.core.errors import ConfigError
from pipeline.core.geometry import build_store_groups
from pipeline.core.layout import KVCacheLayout
from pipeline.core.runs import value_span
from tests.kit import hybrid_layout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a host without a GPU")
async def test_cuda_copies_are_refused_at_start_without_a_gpu() -> None:
    """``store.engine_memory: cuda`` on a host where torch sees no GPU stops the start
    with an error naming the setting."""
    config = Config()
    transfer = msgspec.structs.replace(config.stages.transfer, device="cuda")
    config = msgspec.structs.replace(
        config, stages=msgspec.structs.replace(config.stages, transfer=transfer))
    with pytest.raises(ConfigError, match=r"store\.engine_memory is cuda, but torch"):
        async with open_backends(config, Faults(FaultsConfig()), on_evicted=print):
            pass


def test_kernel_forms_hold_nothing_of_the_engines_memory() -> None:
    """What waits for a GPU kernel compile (as an engine registers) names each store
    group's device, word, row stride, value size and seed, and holds no reference to its
    blocks: an engine's memory is freed as soon as its session lets go of it, compiled
    or not."""
    layout = KVCacheLayout.from_dict(hybrid_layout(page_bytes=4096))
    caches = {layer: torch.zeros((8, 4096), dtype=torch.uint8)
              for group in layout.groups for layer in group.layers}
    geometries = build_store_groups(layout, {layer: (t, 0) for layer, t in caches.items()})
    alive = [weakref.ref(tensor) for tensor in caches.values()]
    forms = kernel_forms(geometries)
    assert forms == {
        KernelForms(torch.device("cpu"), 8, value_span(g.stored_bytes), g.value_bytes,
                    g.checksum_seed) for g in geometries}
    del caches, geometries
    gc.collect()
    assert [ref() for ref in alive] == [None] * len(alive)
    compile_kernels(forms)  # none on a GPU: nothing to compile, nothing launched

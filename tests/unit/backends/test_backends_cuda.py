"""The copy-engine choice at the root: CUDA copies are chosen by config, and refused at
start where torch sees no GPU, before any engine could register."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pipeline.app.backends import open_backends
from pipeline.backends.faults import Faults
from pipeline.core.config import Config, FaultsConfig
from pipeline.core.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a host without a GPU")
async def test_cuda_copies_are_refused_at_start_without_a_gpu() -> None:
    """``stages.transfer.device: cuda`` on a host where torch sees no GPU stops the
    start with an error naming the setting."""
    config = Config()
    transfer = msgspec.structs.replace(config.stages.transfer, device="cuda")
    config = msgspec.structs.replace(
        config, stages=msgspec.structs.replace(config.stages, transfer=transfer))
    with pytest.raises(ConfigError, match=r"stages\.transfer\.device is cuda, but torch"):
        async with open_backends(config, Faults(FaultsConfig()), on_evicted=print):
            pass

"""Checksums beside vLLM-format values, in a store vLLM's own connector reads too.

A staging row is ``[value | checksum]``. The value goes under its key exactly as vLLM
writes it; the checksum under the key plus ``@xxh3``, which vLLM never reads. A value
found without its checksum (vLLM wrote it, or the checksum was evicted) is refused
(``store.verify: required``) or sealed on arrival and loaded as it is (``if_present``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.core.integrity import CHECKSUM_BYTES, VLLM_FORMAT_SEED, checksum
from pipeline.core.outcomes import LOADED, MISSING, BlockStatus, KeyOutcome
from pipeline.core.store import KVStore, Presence

__all__ = ["CHECKSUM_SUFFIX", "UNVERIFIED", "ChecksumBesideStore"]

CHECKSUM_SUFFIX = "@xxh3"
UNVERIFIED = KeyOutcome(BlockStatus.FAILED, Presence.UNVERIFIED.value)


def _beside(keys: Sequence[str]) -> list[str]:
    return [key + CHECKSUM_SUFFIX for key in keys]


def _split(rows: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [row[:-CHECKSUM_BYTES] for row in rows], [row[-CHECKSUM_BYTES:] for row in rows]


class ChecksumBesideStore:
    """A ``KVStore`` of staging rows over a store of vLLM-format values: each call is one
    call of the inner store, values and checksums together."""

    def __init__(self, inner: KVStore, *, require: bool) -> None:
        self.inner = inner
        self._require = require

    async def register_buffer(self, buffer: torch.Tensor) -> None:
        await self.inner.register_buffer(buffer)

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        found = await self.inner.exists(
            [*keys, *_beside(keys)],
            [*(size - CHECKSUM_BYTES for size in sizes), *[CHECKSUM_BYTES] * len(keys)],
        )
        values, sums = found[: len(keys)], found[len(keys) :]
        return [
            Presence.UNVERIFIED
            if value is Presence.PRESENT and sealed is not Presence.PRESENT and self._require
            else value
            for value, sealed in zip(values, sums, strict=True)
        ]

    async def put(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> list[KeyOutcome]:
        payloads, sums = _split(values)
        # Checksums first: a reader that finds the value finds its checksum.
        outcomes = await self.inner.put([*_beside(keys), *keys], [*sums, *payloads])
        return outcomes[len(keys) :]

    async def get_into(
        self, keys: Sequence[str], buffers: Sequence[torch.Tensor]
    ) -> list[KeyOutcome]:
        payloads, sums = _split(buffers)
        outcomes = await self.inner.get_into([*keys, *_beside(keys)], [*payloads, *sums])
        result = outcomes[: len(keys)]
        for index, sealed in enumerate(outcomes[len(keys) :]):
            if result[index] != LOADED or sealed == LOADED:
                continue
            if sealed != MISSING or self._require:
                result[index] = UNVERIFIED
            else:  # loaded as it is: sealed here so that the scatter's check passes
                sums[index].copy_(torch.frombuffer(
                    bytearray(checksum(payloads[index], VLLM_FORMAT_SEED)), dtype=torch.uint8
                ))
        return result

    async def remove(self, keys: Sequence[str]) -> int:
        return await self.inner.remove([*keys, *_beside(keys)])

    async def aclose(self) -> None:
        await self.inner.aclose()

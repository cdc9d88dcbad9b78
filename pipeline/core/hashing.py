"""Chained block hashes, byte-identical to vLLM 0.33 ``hash_block_tokens`` + ``sha256_cbor``.

``h_i = sha256(cbor(parent, tuple(tokens_i), extra_keys_i))`` with ``parent = h_{i-1}``
or ``NONE_HASH`` for the first block. ``NONE_HASH`` is ``sha256_cbor(seed)`` where the
seed is ``"vllm-none-hash"`` unless the engine set ``PYTHONHASHSEED``.

A block with no extra keys whose token ids fit in uint32 (every request without LoRA,
multimodal items or a cache salt) is hashed by ``_blockhash.chain``, in C without the
GIL; the same bytes as the Python spelling below, which hashes everything else.
"""

from __future__ import annotations

import array
import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import cbor2

from pipeline.core._blockhash import chain as _chain
from pipeline.core.messages import TOKEN_TYPECODE, RequestKeys, pack_tokens

__all__ = [
    "DEFAULT_SEED",
    "INLINE_KEYED_TOKENS",
    "INLINE_TOKENS",
    "MMItem",
    "RequestHasher",
    "block_hashes",
    "group_block_hashes",
    "hashed_inline",
    "none_hash",
    "sha256_cbor",
    "uint32_tokens",
]

DEFAULT_SEED = "vllm-none-hash"
INLINE_TOKENS = 8192
"""Requests of this many tokens or fewer are hashed on the event loop. The native hash
takes some 15 ns a token (16-token blocks; less per token in larger ones), so 8192 cost
about 0.12 ms, less than a hop to a worker thread or stage (measured at 1024 tokens: a
thread cost 0.35 ms more of a save's time, 0.15 ms more of the event loop's). Longer
prompts are hashed where the loop does not stall on them."""
INLINE_KEYED_TOKENS = 512
"""The same for a request with keys (a LoRA, a salt, multimodal items): its blocks are
hashed in Python, some 10 us a block, one-token blocks at worst."""


def hashed_inline(tokens: int, keys: RequestKeys) -> bool:
    """Whether a request of ``tokens`` tokens with ``keys`` is hashed on the event loop."""
    simple = keys.lora_name is None and keys.cache_salt is None and not keys.mm_items
    return tokens <= (INLINE_TOKENS if simple else INLINE_KEYED_TOKENS)

MMItem = tuple[str, int, int]
"""A multimodal item: (identifier, offset of its first placeholder token, length)."""

_sha256 = hashlib.sha256
_dumps = cbor2.dumps
_HASH_BYTES = _sha256().digest_size
"""Bytes of one block hash."""


def sha256_cbor(value: Any) -> bytes:
    return _sha256(_dumps(value, canonical=True)).digest()


@functools.lru_cache(maxsize=64)
def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of every request's first block, for a ``PYTHONHASHSEED``-style seed."""
    return sha256_cbor(DEFAULT_SEED if seed is None else seed)


class RequestHasher:
    """Hashes one request's blocks incrementally: a growing request is never rehashed.

    Extra keys are fixed per request (LoRA, multimodal items, cache salt), as in vLLM.
    """

    __slots__ = (
        "_block", "_extra_static", "_hashes", "_mm", "_mm_next", "_parent", "_salt", "_simple",
    )

    def __init__(
        self,
        hash_block_size: int,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MMItem] = (),
        seed: str | None = None,
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self._block = hash_block_size
        self._extra_static: tuple[Any, ...] = (
            (("lora", lora_name, lora_path or ""),) if lora_name is not None else ()
        )
        self._salt = cache_salt or None
        self._mm: list[MMItem] = sorted(
            ((ident, offset, length) for ident, offset, length in mm_items),
            key=lambda item: item[1],
        )
        self._mm_next = 0
        self._hashes: list[bytes] = []
        self._parent = none_hash(seed)
        self._simple = not (self._extra_static or self._salt or self._mm)

    @property
    def hashes(self) -> list[bytes]:
        """Hashes of every full block seen so far (the caller must not mutate it)."""
        return self._hashes

    def chain(self) -> tuple[bytes, int]:
        """What ``resume`` needs to go on with this chain: its hashes back to back (one
        bytes object, which the cycle collector never tracks), and how far its
        multimodal items are consumed (the rest comes from the request's keys)."""
        return b"".join(self._hashes), self._mm_next

    def resume(self, hashes: bytes, mm_next: int) -> None:
        """Go on with a chain ``chain`` gave, of a hasher made for the same request keys
        and seed; this one has hashed nothing yet."""
        assert not self._hashes, "resume() is for a fresh hasher"
        # Cut in one C call: 512 hashes in 9 µs, against 56 for a slice each.
        count = len(hashes) // _HASH_BYTES
        self._hashes = list(struct.unpack(f"{_HASH_BYTES}s" * count, hashes))
        self._mm_next = mm_next
        if self._hashes:
            self._parent = self._hashes[-1]

    def extend(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hash the full blocks of ``token_ids`` not hashed yet; return all hashes.

        ``token_ids`` is the whole request so far; its prefix must equal what was hashed.
        """
        size = self._block
        hashes = self._hashes
        first = len(hashes) * size
        end = first + (len(token_ids) - first) // size * size  # past the last full block
        if end <= first:  # decode steps mostly end here: no new full block
            return hashes
        parent = self._parent
        sha256, dumps, append = _sha256, _dumps, hashes.append
        if self._simple and (ids := uint32_tokens(token_ids, first, end)) is not None:
            new = _chain(parent, ids, size)  # the usual request: natively, ~4x quicker
            hashes.extend(new)
            parent = new[-1]
        elif self._simple:
            for start in range(first, end, size):
                tokens = tuple(token_ids[start : start + size])
                parent = sha256(dumps((parent, tokens, None), canonical=True)).digest()
                append(parent)
        else:
            extra_keys = self._extra_keys
            for start in range(first, end, size):
                tokens = tuple(token_ids[start : start + size])
                extra = extra_keys(start, start + size)
                parent = sha256(dumps((parent, tokens, extra), canonical=True)).digest()
                append(parent)
        self._parent = parent
        return hashes

    def _extra_keys(self, start: int, end: int) -> tuple[Any, ...] | None:
        keys: list[Any] = list(self._extra_static)
        mm = self._mm
        index = self._mm_next
        while index < len(mm):
            identifier, offset, length = mm[index]
            if offset >= end:
                break
            if offset + length > start:
                keys.append(("mm", identifier, offset - start))
            if offset + length <= end:
                index += 1  # ends in this block: later blocks never see it again
            else:
                break
        self._mm_next = index
        if start == 0 and self._salt:
            keys.append(("cache_salt", self._salt))
        return tuple(keys) if keys else None


def uint32_tokens(
    token_ids: Sequence[int], start: int, end: int,
) -> memoryview | array.array[int] | None:
    """``token_ids[start:end]`` as native uint32s, for the native chain and for a kept
    chain's tokens (an ``array('I')``, as received, without a copy); None when one is out
    of that range (hashed in Python, as CBOR spells any integer)."""
    if isinstance(token_ids, array.array) and token_ids.typecode == TOKEN_TYPECODE:
        return memoryview(token_ids)[start:end]
    try:
        return pack_tokens(token_ids[start:end])
    except ValueError:
        return None


def block_hashes(
    token_ids: Sequence[int],
    hash_block_size: int,
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MMItem] = (),
    seed: str | None = None,
) -> list[bytes]:
    """Fine block hashes of every full ``hash_block_size`` chunk of ``token_ids``."""
    hasher = RequestHasher(
        hash_block_size, lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt,
        mm_items=mm_items, seed=seed,
    )
    return hasher.extend(token_ids)


def group_block_hashes(
    fine_hashes: Sequence[bytes], hash_block_size: int, group_block_size: int
) -> list[bytes]:
    """The coarse view for a group whose block spans k fine blocks: ``h[(j+1)*k - 1]``."""
    if group_block_size % hash_block_size:
        raise ValueError(
            f"group block_size {group_block_size} is not a multiple of "
            f"hash_block_size {hash_block_size}"
        )
    k = group_block_size // hash_block_size
    if k == 1:
        return list(fine_hashes)
    return list(fine_hashes[k - 1 :: k])

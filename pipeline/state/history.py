"""Why a block is absent: a bounded record of what became of recently saved blocks.

Each finished save leaves, per block, what came of it (stored, skipped and why, failed)
under its key; evictions and loads that failed their checksum are noted on the same
record. Beside it two indexes answer "is it stored under another name?": the key
prefix each block (store group, hash) was last stored under (another namespace, rank or
value format), and the request keys (cache salt, LoRA, multimodal inputs) that the same
tokens were last stored with. Every index keeps only its most recent ``max_blocks``.
Both are kept per tenant: what one tenant stored never explains another's miss.

Saves refused before their blocks were hashed (an overloaded sidecar answers them at
once) are kept apart, one record per request holding its tokens (the message's own
array, not a copy), so that a flood of them costs little and never pushes the blocks'
own records out.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

import msgspec
import xxhash

from pipeline.core.messages import RequestKeys, TokenIds, compact_keys
from pipeline.core.outcomes import BlockStatus, KeyOutcome
from pipeline.core.store import Presence

__all__ = ["BlockHistory", "Prompt", "SavedBlock", "Verdict", "content_prints"]

K = TypeVar("K")
V = TypeVar("V")


class Verdict(enum.StrEnum):
    PRESENT = "present"
    UNUSABLE = "unusable"
    """Stored, but not readable as this engine's value (another size, no checksum)."""
    NEVER_STORED = "never_stored"
    SKIPPED = "skipped"
    FAILED = "failed"
    FAILED_INTEGRITY = "failed_integrity"
    EVICTED = "evicted"
    OTHER_NAMESPACE = "other_namespace"
    """The same block hash is stored under another key prefix."""
    OTHER_KEYS = "other_keys"
    """The same tokens were stored under another cache salt, LoRA or multimodal input."""
    UNKNOWN = "unknown"
    """The store could not be asked."""


class _Record(msgspec.Struct, frozen=True, gc=False):
    """What became of a block: its verdict, why, and when (monotonic seconds).

    Untracked by the cycle collector, as are the other indexes' keys and values (bytes,
    ints, request keys of strings): under load every index is rewritten between two
    collections, and tracked records would be walked by each one (as tuples, 16k of the
    45-80k objects each young collection walked under a flood)."""

    verdict: Verdict
    reason: str
    at: float


class _Bounded(collections.OrderedDict[K, V], Generic[K, V]):
    """A mapping that forgets its least recently written entries past ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: K, value: V) -> None:
        self.put_all(((key, value),))

    def put_all(self, items: Iterable[tuple[K, V]]) -> None:
        """Write each in turn (a key written again becomes the most recent), then forget
        the oldest past the limit: the same as writing them one by one."""
        forget = self.pop
        for key, value in items:
            forget(key, None)
            self[key] = value
        for _ in range(len(self) - self.limit):
            self.popitem(last=False)


SavedBlock = tuple[str, str, tuple[int, bytes], KeyOutcome, int | None]
"""One block of a finished save: its key, the key prefix it was saved under, its (store
group, block hash), what came of it, and the print of the tokens up to its end (None:
none)."""

REQUESTS_PER_PRINT = 2
"""Refused requests remembered per print of their first block (a shared system prompt)."""
REFUSED_TOKENS = 4096
"""Tokens of a refused request remembered (a longer prompt's tail is not explained)."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt being explained: its tokens, the prints of its tokens up to each block's
    end, and where its first block ends."""

    tokens: TokenIds
    prints: dict[int, int]
    first_end: int


def content_prints(token_ids: TokenIds, ends: Sequence[int]) -> dict[int, int]:
    """A fingerprint of the tokens up to each of ``ends`` (token counts), blind to the
    request keys: the same tokens under another salt print the same."""
    data = memoryview(token_ids).cast("B")
    size = token_ids.itemsize
    prints: dict[int, int] = {}
    digest = xxhash.xxh3_64()
    done = 0
    for end in sorted(set(ends)):
        digest.update(data[done * size : end * size])
        done = end
        prints[end] = digest.intdigest()
    return prints


def _print_key(content: int, tenant: str) -> bytes:
    """A tenant's content print as one bytes object (untracked by the collector)."""
    return content.to_bytes(8, "little") + tenant.encode()


def _block_key(block: tuple[int, bytes], tenant: str) -> bytes:
    """A tenant's (store group, block hash) as one bytes object: the hash, the group,
    then the tenant."""
    group, block_hash = block
    return block_hash + group.to_bytes(4, "little") + tenant.encode()


def _keys_kind(stored: RequestKeys, asked: RequestKeys) -> str:
    differs = [name for name, a, b in (
        ("cache salt", stored.cache_salt, asked.cache_salt),
        ("LoRA", (stored.lora_name, stored.lora_path), (asked.lora_name, asked.lora_path)),
        ("multimodal inputs", stored.mm_items, asked.mm_items),
    ) if a != b]
    return " and ".join(differs) or "request keys"


class BlockHistory:
    def __init__(self, max_blocks: int) -> None:
        self.enabled = max_blocks > 0
        self._keys: _Bounded[str, _Record] = _Bounded(max_blocks)
        # (store group, block hash), as bytes -> the key prefix it was last stored under
        self._prefixes: _Bounded[bytes, str] = _Bounded(max_blocks)
        # the print of the tokens up to a stored block's end -> the keys it was saved with
        self._contents: _Bounded[bytes, RequestKeys] = _Bounded(max_blocks)
        # (tenant, the print of a refused request's first block) -> its tokens, keys,
        # reason, when
        self._refused: _Bounded[
            bytes, tuple[tuple[TokenIds, RequestKeys, str, float], ...]
        ] = _Bounded(max(16, max_blocks // 64))

    def saved(self, blocks: Iterable[SavedBlock], keys: RequestKeys,
              tenant: str = "default") -> None:
        """The named blocks of a finished save of ``tenant``'s, saved with request
        ``keys``."""
        now = time.monotonic()
        present = _Record(Verdict.PRESENT, "", now)
        records: list[tuple[str, _Record]] = []
        prefixes: list[tuple[bytes, str]] = []
        contents: list[tuple[bytes, RequestKeys]] = []
        kept = compact_keys(keys)  # a request's keys may be large: remembered by digest
        for key, prefix, block, outcome, content in blocks:
            status = outcome.status
            stored = status is BlockStatus.STORED
            known = None if stored else self._keys.get(key)
            if stored or status is BlockStatus.PRESENT:
                if stored or known is None or known.verdict is not Verdict.PRESENT:
                    records.append((key, present))
                prefixes.append((_block_key(block, tenant), prefix))
                if content is not None:
                    contents.append((_print_key(content, tenant), kept))
            elif known is None or known.verdict is not Verdict.PRESENT:
                # (one stored before: a later skip says nothing about where it went)
                verdict = Verdict.SKIPPED if status is BlockStatus.SKIPPED else Verdict.FAILED
                records.append((key, _Record(verdict, outcome.reason, now)))
        self._keys.put_all(records)
        self._prefixes.put_all(prefixes)
        self._contents.put_all(contents)

    def refused(self, first: int, tokens: TokenIds, outcome: KeyOutcome,
                keys: RequestKeys, tenant: str = "default") -> None:
        """A save refused before its blocks were named (hashed); ``first`` is the print
        of its tokens up to its first block's end."""
        if len(tokens) > REFUSED_TOKENS:
            tokens = tokens[:REFUSED_TOKENS]
        record = (tokens, compact_keys(keys), outcome.reason, time.monotonic())
        key = _print_key(first, tenant)
        self._refused.put(key, (record, *self._refused.get(key, ())[:REQUESTS_PER_PRINT - 1]))

    def load_failed(self, key: str, outcome: KeyOutcome) -> None:
        """A load found the block's value corrupt (and the store dropped it)."""
        self._keys.put(key, _Record(Verdict.FAILED_INTEGRITY, outcome.reason, time.monotonic()))

    def evicted(self, keys: Sequence[str]) -> None:
        evicted = _Record(Verdict.EVICTED, "evicted to make room", time.monotonic())
        known = self._keys
        known.put_all([(key, evicted) for key in keys if key in known])

    def why(
        self, key: str, prefix: str, block: tuple[int, bytes], presence: Presence,
        keys: RequestKeys, prompt: Prompt | None = None, end: int = 0, *,
        tenant: str = "default",
    ) -> tuple[Verdict, str, float]:
        """Why the block under ``key`` is (not) a hit for ``tenant``: its verdict, a
        reason, and how long ago (seconds) what it says happened (-1: unknown).
        ``prompt``: the tokens asked about (None: only their hashes), the block ending
        after ``end`` of them."""
        now = time.monotonic()
        if presence is Presence.PRESENT:
            return Verdict.PRESENT, "", -1.0
        if presence is not Presence.ABSENT:
            return Verdict.UNUSABLE, presence.value, -1.0
        known = self._keys.get(key)
        if known is not None:
            if known.verdict is Verdict.PRESENT:  # stored, since gone without our seeing why
                return Verdict.EVICTED, "stored, since gone from the store", now - known.at
            return known.verdict, known.reason, now - known.at
        other = self._prefixes.get(_block_key(block, tenant))
        if other is not None and other != prefix:
            return Verdict.OTHER_NAMESPACE, f"stored under {other}", -1.0
        if prompt is None:
            return self._never()
        keys = compact_keys(keys)  # as remembered
        saved_keys = self._contents.get(_print_key(prompt.prints[end], tenant))
        if saved_keys is not None and saved_keys != keys:
            return (Verdict.OTHER_KEYS, f"the same tokens were saved with another "
                    f"{_keys_kind(saved_keys, keys)}", -1.0)
        for tokens, refused_keys, reason, at in self._refused.get(
                _print_key(prompt.prints[prompt.first_end], tenant), ()):
            if refused_keys == keys and len(tokens) >= end and tokens[:end] == (
                    prompt.tokens[:end]):
                return Verdict.SKIPPED, f"{reason} (the save was refused)", now - at
        return self._never()

    def _never(self) -> tuple[Verdict, str, float]:
        if not self.enabled:
            return Verdict.NEVER_STORED, "no record is kept (explain.max_blocks is 0)", -1.0
        return (Verdict.NEVER_STORED,
                f"no save of it among the last {self._keys.limit} blocks recorded", -1.0)

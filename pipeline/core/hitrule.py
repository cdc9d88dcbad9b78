"""The hybrid-model hit rule (ARCHITECTURE §5): where may a request resume from the store?

A prefix of P tokens is usable when every stored group can resume at P: full attention
needs all of its blocks before P, sliding window the blocks covering the window before P,
Mamba (align) the state block ending at P. P is a multiple of the layout's lookup
alignment and of each group's block size (whole blocks only are ever stored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipeline.core.layout import GroupKind, KVCacheGroup, KVCacheLayout

__all__ = ["blocks_to_load", "longest_hit", "max_hit_tokens", "required_blocks"]


def required_blocks(group: KVCacheGroup, tokens: int) -> range | None:
    """Block indices a group needs to resume at ``tokens``; None if it cannot resume there."""
    size = group.block_size
    if tokens % size:
        return None
    end = tokens // size
    if tokens == 0:
        return range(0)
    if group.kind is GroupKind.MAMBA:
        return range(end - 1, end)
    if group.kind is GroupKind.SLIDING_WINDOW:
        assert group.sliding_window is not None
        # Position P attends to the window - 1 tokens before it.
        first_token = max(0, tokens - (group.sliding_window - 1))
        return range(first_token // size, end)
    return range(end)


def blocks_to_load(group: KVCacheGroup, tokens: int, computed_tokens: int = 0) -> range | None:
    """The blocks a load writes to resume at ``tokens`` when the engine already holds the
    first ``computed_tokens``: the required ones that end after those."""
    needed = required_blocks(group, tokens)
    if needed is None:
        return None
    return range(max(needed.start, computed_tokens // group.block_size), needed.stop)


def max_hit_tokens(layout: KVCacheLayout, num_tokens: int) -> int:
    """The largest P a lookup may report: at most num_tokens - 1 (the last token is
    always recomputed), aligned down to the lookup alignment."""
    align = layout.lookup_alignment
    return max(0, (num_tokens - 1) // align * align)


def longest_hit(
    layout: KVCacheLayout, max_tokens: int, available: Callable[[int, int], bool]
) -> int:
    """Longest P <= max_tokens (aligned) at which every stored group can resume.

    ``available(store_group, block_index)`` says whether that block can be had.
    """
    align = layout.lookup_alignment
    groups: Sequence[KVCacheGroup] = layout.store_groups
    # Full-attention groups need an unbroken prefix: compute it once instead of per P.
    # Sliding-window groups need an unbroken run of a window's blocks before P: the run
    # ending at each block, computed once, answers that for any P in one step (walking
    # each window anew would cost windows x prompts, a window being up to the prompt).
    prefix_end: dict[int, int] = {}
    runs: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        limit = max_tokens // group.block_size
        if group.kind is GroupKind.SLIDING_WINDOW:
            run, length = [], 0
            for block in range(limit):
                length = length + 1 if available(index, block) else 0
                run.append(length)
            runs[index] = run
        elif group.kind is not GroupKind.MAMBA:
            end = 0
            while end < limit and available(index, end):
                end += 1
            prefix_end[index] = end
    for tokens in range(max_tokens // align * align, 0, -align):
        if _resumable(groups, prefix_end, runs, tokens, available):
            return tokens
    return 0


def _resumable(
    groups: Sequence[KVCacheGroup],
    prefix_end: dict[int, int],
    runs: dict[int, list[int]],
    tokens: int,
    available: Callable[[int, int], bool],
) -> bool:
    for index, group in enumerate(groups):
        needed = required_blocks(group, tokens)
        if needed is None:
            return False
        if index in prefix_end:
            if needed.stop > prefix_end[index]:
                return False
        elif index in runs:
            run = runs[index]
            if needed and (needed.stop > len(run) or run[needed.stop - 1] < len(needed)):
                return False
        elif not all(available(index, block) for block in needed):
            return False
    return True

"""The checks a request passes before it is taken: what it names must fit the session's
layout and the configured limits, and any block hashes it brings must match its tokens.
Each raises ``RequestRejected`` (or ``LimitExceeded``) naming what is wrong."""

from __future__ import annotations

from pipeline.core.config import LimitsConfig
from pipeline.core.errors import ProtocolError, RequestRejected
from pipeline.core.hitrule import blocks_to_load
from pipeline.core.layout import NULL_BLOCK_ID
from pipeline.core.messages import (
    ErrorCode,
    Load,
    Lookup,
    Save,
    prompt_length,
)
from pipeline.state.sessions import EngineSession

__all__ = ["check_engine_hashes", "check_prompt_head", "check_request"]


def check_engine_hashes(session: EngineSession, message: Lookup | Save | Load) -> None:
    """Engine-sent block hashes must match the tokens in number and, on a sample (the
    first block), in value: a wrong hash would name another prefix's KV."""
    if message.block_hashes is None:
        if session.engine_hashes_only:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                "this engine hashes blocks with an algorithm the sidecar does not compute: "
                "send block_hashes with every request",
            )
        return
    hbs = session.layout.hash_block_size
    tokens = prompt_length(message)
    expected = tokens // hbs
    if len(message.block_hashes) != expected:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"{len(message.block_hashes)} block hashes for {tokens} tokens; "
            f"expected {expected} (hash_block_size {hbs})",
        )
    if session.engine_hashes_only:
        return
    if expected and message.block_hashes[0] != session.first_block_hash(
            message.keys, message.token_ids[:hbs].tobytes()):
        raise RequestRejected(
            ErrorCode.HASH_MISMATCH,
            "the first block hash differs from the sidecar's hash of the same tokens",
        )


def check_prompt_head(session: EngineSession, message: Lookup) -> None:
    """A lookup sending only the head of its prompt (``prompt_tokens``) must name every
    block by the engine's hash and send at least the first block, which is checked
    against the first hash: the sidecar hashes and explains only tokens it was sent."""
    length = message.prompt_tokens
    if length is None:
        return
    if message.block_hashes is None or message.explain:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            "a lookup sending only its prompt's first block (prompt_tokens) needs the "
            "engine's block_hashes, and cannot be explained",
        )
    head = min(length, session.layout.hash_block_size)
    if not head <= len(message.token_ids) <= length:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"{len(message.token_ids)} tokens sent of a {length}-token prompt; "
            f"expected at least its first {head}",
        )


def check_block_counts(session: EngineSession, message: Save | Load,
                        limits: LimitsConfig) -> None:
    """Refuse block-id lists longer than a request can use, before anything walks them:
    a save names no more blocks than its tokens reach; a load's lists are bounded by the
    blocks the engine registered (the connector sends every block of its request) and by
    the longest request."""
    longest = min(limits.max_request_tokens,
                  limits.max_request_blocks * session.layout.hash_block_size)
    if len(message.block_ids) != len(session.layout.groups):
        return  # refused by check_block_ids
    stored = {geometry.kv_group_id: geometry for geometry in session.store_groups}
    for group_id, (group, ids) in enumerate(
            zip(session.layout.groups, message.block_ids, strict=True)):
        if isinstance(message, Save):
            most = -(-len(message.token_ids) // group.block_size)
            what = f"a save of {len(message.token_ids)} tokens reaches {most}"
        else:
            most = -(-longest // group.block_size)
            what = f"a request reaches at most {most}"
            if group_id in stored:
                most = min(most, stored[group_id].num_blocks)
                what = f"the engine registered {most}"
        if len(ids) > most:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"{len(ids)} block ids for kv-cache group {group_id}; {what}",
            )


def check_request(session: EngineSession, message: Save | Load,
                   limits: LimitsConfig) -> None:
    """Reject a save or load that cannot be served, before it is accepted."""
    if session.lookup_only:
        raise RequestRejected(
            ErrorCode.BAD_REQUEST, "this engine registered for lookups only: it cannot save or load"
        )
    check_block_counts(session, message, limits)
    check_engine_hashes(session, message)
    try:
        projected = session.check_block_ids(message.block_ids)
    except ProtocolError as exc:
        raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from exc
    if not isinstance(message, Load):
        return
    tokens = message.num_tokens
    if tokens > len(message.token_ids):
        raise RequestRejected(
            ErrorCode.BAD_REQUEST,
            f"num_tokens {tokens} exceeds the request's {len(message.token_ids)} tokens",
        )
    for geometry, block_ids in zip(session.store_groups, projected, strict=True):
        needed = blocks_to_load(geometry.group, tokens, message.computed_tokens)
        if needed is None:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"num_tokens {tokens} is not a multiple of kv-cache group "
                f"{geometry.kv_group_id}'s block size {geometry.group.block_size}",
            )
        for block in needed:
            if block >= len(block_ids) or block_ids[block] == NULL_BLOCK_ID:
                raise RequestRejected(
                    ErrorCode.BAD_REQUEST,
                    f"loading {tokens} tokens needs block {block} of kv-cache group "
                    f"{geometry.kv_group_id}, but the engine gave no block for it",
                )
        targets = [block_ids[block] for block in needed]
        if len(set(targets)) != len(targets):
            # Two stored blocks copied into one engine block: whichever lands last wins.
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"loading {tokens} tokens would write block ids {targets} of kv-cache group "
                f"{geometry.kv_group_id}: a block id appears twice",
            )

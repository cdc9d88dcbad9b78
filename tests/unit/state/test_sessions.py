"""An engine session's cache of request hash chains: what a request's next call goes on
with, never another request's or other tokens' chain, and nothing the cycle collector
has to walk."""

from __future__ import annotations

import array
import gc

from pipeline.core.hashing import block_hashes
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import TOKEN_TYPECODE, RequestKeys
from pipeline.state.sessions import EngineSession

BLOCK = 4
SEED = "seed"


def session() -> EngineSession:
    layout = KVCacheLayout.from_dict({"model": "m", "groups": [
        {"kind": "full_attention", "block_size": BLOCK, "layers": ["attn.0"]}]})
    return EngineSession("engine", b"id", layout, (), hash_seed=SEED)


def tokens(count: int, first: int = 1) -> array.array[int]:
    return array.array(TOKEN_TYPECODE, range(first, first + count))


def test_a_kept_chain_goes_on_where_it_stopped_and_hashes_as_a_fresh_one() -> None:
    """A request's next call resumes its chain (the blocks hashed before are not hashed
    again) and every hash equals a fresh hash of the whole prompt, multimodal items and
    cache salt included; the chain is kept untracked by the cycle collector."""
    engine = session()
    for keys in (RequestKeys(), RequestKeys(cache_salt="salt", mm_items=(("img", 5, 6),))):
        prompt = tokens(6 * BLOCK + 1)
        first = engine.take_hasher("r", keys, prompt[: 3 * BLOCK])
        first.extend(prompt[: 3 * BLOCK])
        engine.keep_hasher("r", keys, first, prompt[: 3 * BLOCK])
        assert not any(gc.is_tracked(kept) for kept in engine._hashers.values())
        again = engine.take_hasher("r", keys, prompt)
        assert again.hashes == first.hashes  # resumed, not started afresh
        expected = block_hashes(prompt, BLOCK, seed=SEED, cache_salt=keys.cache_salt,
                                mm_items=keys.mm_items)
        assert again.extend(prompt) == expected


def test_a_chain_is_not_taken_by_other_tokens_keys_or_requests() -> None:
    """Other tokens under the same request id, the same tokens under other request keys
    or another id, and a chain taken already, all start afresh."""
    engine = session()
    prompt = tokens(4 * BLOCK)
    hasher = engine.take_hasher("r", RequestKeys(), prompt)
    hasher.extend(prompt)

    def kept_then_taken(request_id: str, keys: RequestKeys, token_ids: array.array[int]
                        ) -> list[bytes]:
        engine.keep_hasher("r", RequestKeys(), hasher, prompt)
        return engine.take_hasher(request_id, keys, token_ids).hashes

    assert kept_then_taken("r", RequestKeys(), prompt) == hasher.hashes
    assert kept_then_taken("r", RequestKeys(), tokens(4 * BLOCK, first=2)) == []
    assert kept_then_taken("r", RequestKeys(cache_salt="other"), prompt) == []
    assert kept_then_taken("other", RequestKeys(), prompt) == []
    assert engine.take_hasher("r", RequestKeys(), prompt).hashes == hasher.hashes
    assert engine.take_hasher("r", RequestKeys(), prompt).hashes == []  # taken just now


def test_the_cache_forgets_the_least_recently_kept_chains() -> None:
    engine = session()
    prompt = tokens(BLOCK)
    for request in range(4097):
        hasher = engine.take_hasher(str(request), RequestKeys(), prompt)
        hasher.extend(prompt)
        engine.keep_hasher(str(request), RequestKeys(), hasher, prompt)
    assert engine.take_hasher("0", RequestKeys(), prompt).hashes == []
    assert len(engine.take_hasher("1", RequestKeys(), prompt).hashes) == 1
    assert len(engine.take_hasher("4096", RequestKeys(), prompt).hashes) == 1

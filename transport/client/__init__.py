"""The engine side of the protocol.

- ``engine``: ``EngineClient``, an engine's async client;
- ``wire``: the conversation underneath (sequence-matched calls, the give-up protocol);
- ``results``: what calls return, and the messages built from an engine's arguments;
- ``blocking``: clients for threads without an event loop.

Every message goes through the typed msgpack codec of ``pipeline.core.messages``, which is
re-exported here (``encode``, ``decode_sidecar_message``) as the one codec the client speaks.
"""

from pipeline.core.messages import decode_sidecar_message, encode
from transport.client.blocking import BlockingEngineClient, InlineLookupClient, PendingLookup
from transport.client.engine import LOOKUP_SPIN_S, BlockHasher, EngineClient, KVCacheShape
from transport.client.results import Explanation, LoadResult, SaveResult, lookup_message

__all__ = [
    "LOOKUP_SPIN_S", "BlockHasher", "BlockingEngineClient", "EngineClient", "Explanation",
    "InlineLookupClient", "KVCacheShape", "LoadResult", "PendingLookup", "SaveResult",
    "decode_sidecar_message", "encode", "lookup_message",
]

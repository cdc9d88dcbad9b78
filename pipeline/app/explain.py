"""``kvsidecar explain``: why a prompt hits or misses, block by block, as an engine sees it."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import anyio
from rich.console import Console
from rich.table import Table

from pipeline.core.errors import ConfigError
from pipeline.core.messages import BlockWhy
from transport.client import EngineClient, Explanation
from transport.server import load_key_pair, load_public_key

__all__ = ["add_explain_arguments", "run_explain", "show_explanation"]


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="the sidecar's server.endpoint")
    parser.add_argument("--engine", default="",
                        help="the engine id to explain for (default: the only engine)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="token ids, comma-separated")
    prompt.add_argument("--tokens-file", type=Path,
                        help="a file of token ids (JSON list, or separated by commas or spaces)")
    prompt.add_argument("--hashes", help="the engine's block hashes, hex, comma-separated")
    parser.add_argument("--cache-salt", default=None)
    parser.add_argument("--curve-server-key-file", type=Path, default=None,
                        help="the sidecar's public key (a sidecar with CURVE on)")
    parser.add_argument("--curve-key-file", type=Path, default=None,
                        help="a secret key whose public key the sidecar allows")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--json", action="store_true", help="print every block as JSON")


def _token_ids(text: str) -> list[int]:
    text = text.strip()
    try:
        if text.startswith("["):
            return [int(t) for t in json.loads(text)]
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ConfigError(f"token ids must be integers: {exc}") from exc


def _hashes(text: str) -> list[bytes]:
    try:
        return [bytes.fromhex(h.strip()) for h in text.split(",") if h.strip()]
    except ValueError as exc:
        raise ConfigError(f"block hashes must be hex: {exc}") from exc


def runs(blocks: Sequence[BlockWhy]) -> list[tuple[int, int, int, BlockWhy]]:
    """Blocks of one group in a row with the same verdict and reason, as
    (group, first block, last block, the first block's explanation)."""
    found = []
    for (group, _, _), run in itertools.groupby(
            blocks, key=lambda b: (b.group_id, b.verdict, b.reason)):
        members = list(run)
        found.append((group, members[0].block_index, members[-1].block_index, members[0]))
    return found


def show_explanation(explanation: Explanation, console: Console | None = None) -> None:
    table = Table(title=f"hit: {explanation.hit_tokens} tokens")
    for column in ("kv-cache group", "blocks", "verdict", "reason", "when"):
        table.add_column(column)
    for group, first, last, why in runs(explanation.blocks):
        span = str(first) if first == last else f"{first}-{last}"
        when = f"{why.age_s:.1f} s ago" if why.age_s >= 0 else ""
        table.add_row(str(group), span, why.verdict, why.reason, when)
    (console or Console()).print(table)


def run_explain(args: argparse.Namespace) -> int:
    tokens: list[int] = []
    hashes = None
    if args.tokens is not None:
        tokens = _token_ids(args.tokens)
    elif args.tokens_file is not None:
        tokens = _token_ids(args.tokens_file.read_text())
    else:
        hashes = _hashes(args.hashes)
    keys = {} if args.cache_salt is None else {"cache_salt": args.cache_salt}
    if (args.curve_server_key_file is None) != (args.curve_key_file is None):
        raise ConfigError("--curve-server-key-file and --curve-key-file go together")
    server_key, key_pair = None, None
    if args.curve_key_file is not None:
        server_key = load_public_key(args.curve_server_key_file)
        key_pair = load_key_pair(args.curve_key_file)
    explanation = anyio.run(lambda: EngineClient.explain_for(
        args.endpoint, engine_id=args.engine, token_ids=tokens, block_hashes=hashes,
        timeout_s=args.timeout, curve_server_key=server_key, curve_key_pair=key_pair,
        **keys))
    if args.json:
        blocks = [{**{field: getattr(b, field) for field in b.__struct_fields__},
                   "block_hash": b.block_hash.hex()} for b in explanation.blocks]
        print(json.dumps({"hit_tokens": explanation.hit_tokens, "blocks": blocks}))
    else:
        show_explanation(explanation)
    return 0

"""The conformance matrix's cells and how a cell is judged (test kit): shared by
``tests/e2e/test_conformance.py`` and the peers' benchmark, which run the same cells
through kvsidecar and through other KV connectors.

Per model family, engine A saves every prompt of the matrix, engine B (a new process)
serves the same prompts, loading what was saved, and engine C, without a connector,
serves each prompt twice, the second time from vLLM's own prefix cache. A cell passes
when B hits as far as C's second run, generates the same tokens, and its logprobs are
within the family's tolerance of C's second run (see ``verdict``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

__all__ = ["FAMILIES", "OTHER_SALT", "SALT", "Family", "Prompt", "matrix",
           "max_logprob_diff", "output_verdict", "served", "verdict"]


@dataclasses.dataclass(frozen=True)
class Family:
    block_size: int
    """The block size vLLM runs the model at (the GDN hybrid's: raised by vLLM so that
    an attention page holds a padded GDN state)."""
    batch_tokens: int
    tolerance: float
    """Largest logprob difference allowed against C's second run: chunked and
    unchunked prefill (and, for the GDN hybrid, bfloat16 state resumed at a block
    boundary) add up in another order. Fixed from the spread between C's two runs
    measured on this machine (see the note on each)."""
    damaged_group: int
    """The store group whose first stored block the negative control damages."""


FAMILIES = {
    # C's two runs differ by at most ~1e-6 (float32).
    "llama": Family(block_size=32, batch_tokens=256, tolerance=1e-4, damaged_group=0),
    # The full-attention group: B loads only a window of the sliding one.
    "gemma": Family(block_size=32, batch_tokens=256, tolerance=1e-4, damaged_group=1),
    # The GDN state group (store group 0), one layer's SSM state. C's two runs agree
    # exactly, but with the connector configured vLLM 0.32 computes some prompts of
    # this bfloat16 model differently, by up to 3.0e-2, even with no sidecar reachable
    # (B reproduces A, the engine that computed what was stored, exactly).
    "gdn": Family(block_size=640, batch_tokens=640, tolerance=5e-2, damaged_group=0),
}


Prompt = list[int] | dict[str, Any]
"""Token ids, or ``{"tokens": [...], "cache_salt": "..."}``."""

SALT, OTHER_SALT = "tenant-a", "tenant-b"


def matrix(block: int) -> dict[str, Prompt]:
    """The prompts of each cell, for a model of ``block``-token blocks, as engine A
    saves them (B and C serve ``served(matrix(...))``)."""
    rng = random.Random(block)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(1, 512) for _ in range(count)]

    exact = max(2, 600 // block) * block
    first_turn = tokens(exact)
    phrase = tokens(100)
    return {
        "exact_blocks": tokens(exact),
        "one_token_past": tokens(exact + 1),
        "one_block_and_a_token": tokens(block + 1),
        "mid_block": tokens(exact + block // 2),
        "shorter_than_a_block": tokens(block // 2),
        # Within the engine's 2048-token context at every block size.
        "second_turn": first_turn + tokens(block // 3 + (block if block < 100 else 0)),
        "first_turn": first_turn,
        "long": tokens(1900),
        # Its n-grams recur: what n-gram speculation proposes from.
        "repeated": phrase * (exact // 100) + tokens(1),
        "same_salt": {"tokens": tokens(exact + 1), "cache_salt": SALT},
        "other_salt": {"tokens": tokens(exact + 1), "cache_salt": SALT},
    }


def served(cells: dict[str, Prompt]) -> dict[str, Prompt]:
    """The prompts B and C serve: A's, but ``other_salt`` under another salt."""
    salted = cells["other_salt"]
    assert isinstance(salted, dict)
    return {**cells, "other_salt": {**salted, "cache_salt": OTHER_SALT}}


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def verdict(cell: str, first: dict[str, Any], second: dict[str, Any],
            loaded: dict[str, Any], tolerance: float) -> str | None:
    """Why B's result ``loaded`` fails ``cell`` (None: it passes), against C's first and
    second runs. ``other_salt``: A saved the prompt under another salt, so B must hit
    nothing (C's second run hits its own cache), and is judged against C's first run."""
    expected, reference = ((0, first) if cell == "other_salt"
                           else (second["num_cached_tokens"], second))
    got = loaded["num_cached_tokens"]
    if got != expected:
        return f"loaded {got} tokens, expected {expected}"
    if got == 0 and cell not in ("shorter_than_a_block", "other_salt"):
        return "no hit"
    return output_verdict(loaded, reference, tolerance)


def output_verdict(loaded: dict[str, Any], reference: dict[str, Any],
                   tolerance: float) -> str | None:
    """Why ``loaded`` does not generate what ``reference`` did (None: it does): other
    tokens, or logprobs further apart than ``tolerance``."""
    if loaded["tokens"] != reference["tokens"]:
        return "other tokens"
    if (diff := max_logprob_diff(loaded, reference)) > tolerance:
        return f"logprobs differ by {diff:.1e}"
    return None

"""A real sidecar process for testing code that talks to one (an engine's integration).

    with run_sidecar_process({"store": {"embedded": {"capacity_bytes": 1 << 26}}}) as sidecar:
        client = await EngineClient.connect(sidecar.endpoint, layout=..., kv_caches=...)

A sidecar that failed to handle a message of its own fault (``internal``: a bug, which
its guard answered) fails the test that ran it, when the block exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from pipeline.app import launcher
from pipeline.app.launcher import SidecarProcess

__all__ = ["INTERNAL_EVENTS", "SidecarProcess", "run_sidecar_process"]

INTERNAL_EVENTS = ("server.request.internal", "stage.item.internal")
"""The log events of a message, or a part of one, the sidecar failed to handle."""


@contextlib.contextmanager
def run_sidecar_process(
    overrides: Mapping[str, Any] | None = None, *, allow_internal: bool = False,
    **kwargs: Any,
) -> Iterator[SidecarProcess]:
    """``pipeline.app.launcher.run_sidecar_process``; on a clean exit of the block the
    sidecar is stopped, and any ``internal`` failure it logged fails the caller, unless
    ``allow_internal`` (a test that injects one)."""
    with launcher.run_sidecar_process(overrides, **kwargs) as sidecar:
        yield sidecar
        if not allow_internal:
            log = sidecar.final_log()
            failures = [line for line in log.splitlines()
                        if any(event in line for event in INTERNAL_EVENTS)]
            assert not failures, (
                f"the sidecar failed to handle {len(failures)} message(s) (internal): "
                + "\n".join(failures[:3]))

"""A real sidecar process for testing code that talks to one (an engine's integration).

    with run_sidecar_process({"store": {"embedded": {"capacity_bytes": 1 << 26}}}) as sidecar:
        client = await EngineClient.connect(sidecar.endpoint, layout=..., kv_caches=...)
"""

from pipeline.app.launcher import SidecarProcess, run_sidecar_process

__all__ = ["SidecarProcess", "run_sidecar_process"]

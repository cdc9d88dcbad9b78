"""Engine memory in the sidecar: an engine's registered tensors mapped (CPU shared
memory handed over, or CUDA IPC handles opened) within the mapping budget, and the
handover socket CPU memory comes through."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import structlog
import torch

from pipeline.core.config import Config, ServerConfig
from pipeline.core.errors import StoreError, TransportError
from pipeline.core.messages import CudaIpcEvent, TensorHandle
from pipeline.core.store import PiecewiseKVStore
from pipeline.core.tenancy import Peer
from pipeline.state.registry import Handed as RegistryHanded
from pipeline.state.registry import LayerTensors, MappingBudget
from transport.handover import Handed, HandoverDesk
from transport.server import SidecarSocket
from transport.tensors import MappedTensors

__all__ = ["RegisteredMapping", "map_registered_tensors", "map_shared_tensors",
           "open_handover_desk", "step_events"]

log = structlog.get_logger("kvsidecar.service")


@contextlib.contextmanager
def open_handover_desk(
    socket: SidecarSocket, config: ServerConfig
) -> Iterator[HandoverDesk | None]:
    """The handover socket beside an ``ipc://`` endpoint, with its permissions; None
    for tcp, whose peers hand no CPU memory over."""
    if socket.ipc_path is None:
        yield None
        return
    path = socket.ipc_path.with_name(socket.ipc_path.name + ".handover")
    with HandoverDesk(path, permissions=config.ipc_permissions) as desk:
        yield desk


def map_shared_tensors(
    handles: Sequence[TensorHandle], budget: MappingBudget, peer: Peer,
    handed: RegistryHanded | None,
) -> tuple[LayerTensors, MappedTensors]:
    """The tensors ``handles`` describe, in the memory files ``handed`` (which the
    mapping then owns) or in CUDA allocations of ``peer``'s own process."""
    assert handed is None or isinstance(handed, Handed)
    mapper = MappedTensors(handed=handed, owner_pid=peer.pid,
                           max_bytes=budget.max_bytes, limit=budget.limit)
    try:
        tensors = {
            handle.layer: (mapper.map_tensor(handle), handle.block_dim) for handle in handles
        }
        mapper.done_mapping()
    except BaseException:
        mapper.close()
        raise
    if mapper.unsealed:
        # Served all the same: a shrink under the guard reads zeros, never stored.
        log.info("session.memory.unsealed", files=mapper.unsealed, pid=peer.pid)
    return tensors, mapper


class RegisteredMapping:
    """An engine's mapped memory, registered with a store that moves values straight
    from and into it, until the mapping closes (no job of the engine in flight) and no
    store call given up on may still touch it: only then is it unregistered and
    unmapped."""

    def __init__(self, mapping: MappedTensors, store: PiecewiseKVStore,
                 memory: list[torch.Tensor]) -> None:
        self._mapping = mapping
        self._store = store
        self._memory = memory

    def close(self) -> None:
        self._store.when_calls_returned(self._release)

    def _release(self) -> None:
        memory, self._memory = self._memory, []
        for region in memory:
            self._store.unregister_memory(region)
        self._mapping.close()

    def owner_exited(self) -> bool:
        return self._mapping.owner_exited()

    @property
    def mapped_bytes(self) -> int:
        return self._mapping.mapped_bytes

    def lost(self) -> bool:
        return self._mapping.lost()


def map_registered_tensors(
    store: PiecewiseKVStore, handles: Sequence[TensorHandle], budget: MappingBudget,
    peer: Peer, handed: RegistryHanded | None,
) -> tuple[LayerTensors, RegisteredMapping]:
    """``map_shared_tensors``, and the memory under the tensors registered with ``store``
    (each mapping once, whole)."""
    tensors, mapper = map_shared_tensors(handles, budget, peer, handed)
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor, _ in tensors.values():
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    registered: list[torch.Tensor] = []
    try:
        for storage in storages.values():
            region = torch.empty(0, dtype=torch.uint8).set_(storage)
            store.register_memory(region)
            registered.append(region)
    except StoreError as exc:
        RegisteredMapping(mapper, store, registered).close()
        raise TransportError(
            f"the engine's KV memory could not be registered with the store: {exc}") from exc
    return tensors, RegisteredMapping(mapper, store, registered)


def step_events(config: Config) -> Callable[[CudaIpcEvent], torch.cuda.Event] | None:
    """How engines' step events are opened, where GPU tensors are served at all."""
    if config.stages.transfer.device != "cuda":
        return None
    from transport.cuda_ipc import open_step_event

    return open_step_event

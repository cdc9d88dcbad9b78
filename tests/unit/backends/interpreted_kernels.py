"""Runs the GPU kernels (``cuda_digests``, ``cuda_pages``) in Triton's interpreter on
CPU tensors, for ``test_cuda_kernels``: a process of its own, since Triton picks the
interpreter when a kernel's module is imported.

    TRITON_INTERPRET=1 python -m tests.unit.backends.interpreted_kernels IN OUT

reads the cases ``torch.save``d to IN and saves what the kernels made of them to OUT.
"""

from __future__ import annotations

import sys

import torch

from pipeline.backends.cuda_digests import check_on_device, seal_on_device
from pipeline.backends.cuda_pages import copy_pages


def digests(rows: torch.Tensor, payload: int, seed: int, flip: int) -> dict[str, torch.Tensor]:
    """The rows sealed, checked, and checked again with byte ``flip`` of row 1 flipped."""
    sealed = rows.clone()
    seal_on_device(sealed, payload, seed)
    ok = check_on_device(sealed, payload, seed)
    corrupted = sealed.clone()
    corrupted[1, flip] ^= 1
    return {"sealed": sealed, "ok": ok, "ok_corrupted": check_on_device(corrupted, payload, seed)}


def pages(segments: list[torch.Tensor], ids: list[int], rows: torch.Tensor,
          ok: torch.Tensor) -> dict[str, torch.Tensor]:
    """Blocks ``ids`` gathered into the rows (in 4-byte words), then the rows, changed,
    scattered back to blocks ``ids`` past those of flag 0."""
    offsets = [0]
    for segment in segments[:-1]:
        offsets.append(offsets[-1] + segment.shape[1])
    table = torch.tensor(
        [offset // 4 for offset in offsets] + [segment.shape[1] // 4 for segment in segments]
        + [segment[block].data_ptr() for block in ids for segment in segments]
        + list(range(len(ids))), dtype=torch.int64)
    longest = max(segment.shape[1] for segment in segments) // 4
    gathered = rows.clone()
    copy_pages(table, gathered, 4, len(ids), len(segments), longest, to_rows=True)
    changed = gathered ^ 0x5A
    copy_pages(table, changed, 4, len(ids), len(segments), longest, to_rows=False, ok=ok)
    return {"gathered": gathered, "changed": changed, "segments": segments}


def main(source: str, target: str) -> None:
    cases = torch.load(source)
    torch.save({"digests": [digests(**case) for case in cases["digests"]],
                "pages": pages(**cases["pages"])}, target)


if __name__ == "__main__":
    main(*sys.argv[1:])

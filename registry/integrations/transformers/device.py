"""Where a model runs, and moving a verified KV file's bytes onto that device.

A graft is verified on the host (the SHA-256 of every tensor over the bytes in memory) and
only then copied to the model's device, so every byte check stays a comparison of host
bytes. To a CUDA device the bytes go through a small ring of page-locked staging buffers:
a copy from pageable memory makes the driver stage it through its own buffers, one chunk
at a time, at a fraction of the bus's speed, and pinning the whole file (gigabytes) would
cost more than the copy. While one buffer is on its way to the device the next is filled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from kvgraft.digest import Buffer
from kvgraft.errors import UsageError
from kvgraft.transfer.materialise import KVBuffer

STAGE_BYTES = 64 << 20  # per staging buffer: large enough that a copy's fixed cost vanishes
STAGE_DEPTH = 2  # one filling while one is copied
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def resolve_device(spec: str | None) -> Any:
    """The torch device named `spec` (cpu, cuda, cuda:N; None is the CPU), checked to
    exist here: a CUDA device on a machine without one is a usage error, not a traceback
    from deep inside the model's load."""
    if spec is None:
        return torch.device("cpu")
    m = _DEVICE.fullmatch(spec.strip().lower())
    if m is None or (m.group(1) == "cpu" and m.group(2) not in (None, "0")):
        raise UsageError(f"unknown device {spec!r}", hint="use cpu, cuda or cuda:N")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        raise UsageError(f"device {spec!r} asked for, but {why} (torch {torch.__version__})",
                         hint="run on the CPU (--device cpu) or on a machine with a GPU")
    index = int(m.group(2)) if m.group(2) is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise UsageError(f"device {spec!r} asked for, but this machine has {count} CUDA "
                         f"device{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


def to_device(buf: KVBuffer | Buffer, spans: Sequence[tuple[int, int]], device: Any, *,
              stage_bytes: int = STAGE_BYTES, depth: int = STAGE_DEPTH,
              pin: bool | None = None) -> list[Any]:
    """Copies of the byte ranges (offset, length) of `buf` on `device`, as flat uint8
    tensors, through `depth` staging buffers of `stage_bytes` (page-locked for a CUDA
    device unless `pin` says otherwise). Returns when every copy has landed."""
    device = torch.device(device)
    pin = device.type == "cuda" if pin is None else pin
    host = torch.frombuffer(buf, dtype=torch.uint8)
    largest = max((n for _, n in spans), default=0)
    size = max(1, min(stage_bytes, largest))
    stages = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(depth)]
    landed: list[Any] = [None] * depth  # the event after which a staging buffer is free
    out = []
    k = 0
    for begin, nbytes in spans:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for off in range(0, nbytes, size):
            n = min(size, nbytes - off)
            slot = k % depth
            k += 1
            if landed[slot] is not None:
                landed[slot].synchronize()
            stage = stages[slot][:n]
            stage.copy_(host[begin + off : begin + off + n])
            dst[off : off + n].copy_(stage, non_blocking=pin)
            if pin and device.type == "cuda":
                landed[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
                landed[slot].record(torch.cuda.current_stream(device))
        out.append(dst)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return out


def synchronize(device: Any) -> None:
    """Wait for the device's queued work (a no-op on the CPU): timings must include it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

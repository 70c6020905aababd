"""Pipeline stages: each worker of a pipeline-parallel engine holds a contiguous run of the
model's layers (vLLM's `get_pp_indices`). A restore needs nothing from the other stages:
each writes its own layers of the graft. A publish needs every layer in one process: the
leader of each stage (its tensor-parallel rank 0, which holds all heads once the ranks'
slices are gathered) sends its layers to the last stage's leader, which stores the graft.

The exchange runs on a thread of its own, over a gloo group of its own, never on vLLM's
groups nor inside a forward: a stage hands a request's layers over after its forward and
goes on, and only the exchange thread of the last stage waits for the others. Every stage
reads the same scheduler metadata in the same order, so every leader exchanges the same
requests in the same order. Nothing is dropped before the exchange (a stage that skipped
one would leave the last stage waiting for it); what the exchange cannot send is sent as
"nothing", and the last stage then publishes nothing for that request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvgraft.errors import RegistryError

log = logging.getLogger("vllm.kvgraft")

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [heads, tokens, dim]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a worker stands in the pipeline: its stage, every stage's layers [first, end),
    and whether it leads its stage (tensor-parallel rank 0)."""

    stage: int
    spans: tuple[tuple[int, int], ...]
    leader: bool

    @property
    def first(self) -> int:
        return self.spans[self.stage][0]

    @property
    def count(self) -> int:
        first, end = self.spans[self.stage]
        return end - first

    @property
    def last(self) -> bool:
        return self.stage == len(self.spans) - 1


def layout(layers: int, indices: Sequence[int], stage: int, stages: int,
           leader: bool) -> Layout:
    """This worker's place in the pipeline, from vLLM's own split of the layers; refused
    (`RegistryError`) unless the paged layers vLLM gave this worker are exactly its
    stage's."""
    from vllm.distributed.utils import get_pp_indices

    spans = tuple(get_pp_indices(layers, s, stages) for s in range(stages))
    first, end = spans[stage]
    if list(indices) != list(range(first, end)):
        raise RegistryError(f"pipeline stage {stage} of {stages} holds paged KV layers "
                            f"{_runs(indices)}, expected {first}-{end - 1}")
    return Layout(stage, spans, leader)


def _runs(indices: Sequence[int]) -> str:
    return f"{indices[0]}-{indices[-1]}" if indices else "none"


def leaders_group(leaders: Sequence[int]) -> _Group:
    """A gloo group of the stages' leaders (global ranks, stage order), of the exchange's
    own. Every worker of the engine must call it, leader or not (torch's rule for
    `new_group`)."""
    import torch.distributed as dist

    return _Group(dist.new_group(list(leaders), backend="gloo"), tuple(leaders))


@dataclass(frozen=True, slots=True)
class _Group:
    group: Any
    leaders: tuple[int, ...]


class Exchange:
    """The stage leaders' exchange of published layers. `joined(token, layers)` runs on
    the last stage's leader, in its exchange thread, with every layer of the model (None
    where a stage had nothing to send)."""

    def __init__(self, at: Layout, group: _Group, dtype: torch.dtype,
                 joined: Callable[[Any, Layers | None], None]) -> None:
        self._at, self._dtype, self._joined = at, dtype, joined
        self._group, self._leaders = group.group, list(group.leaders)
        self._queue: queue.SimpleQueue[tuple[Any, Layers] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if at.leader:
            self._thread = threading.Thread(target=self._run, name="kvgraft-stages",
                                            daemon=True)
            self._thread.start()

    def submit(self, token: Any, layers: Layers) -> None:
        """Hand this stage's layers of one publish over (leaders only; never blocks)."""
        self._queue.put((token, layers))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            token, layers = item
            try:
                if not self._at.last:
                    self._send(layers)
                    continue
                joined = self._receive(layers)
            except Exception as e:  # a peer gone: no later exchange can line up again
                log.error("kvgraft: pipeline stages' exchange stopped, nothing more is "
                          "published: %s", e)
                return
            try:
                self._joined(token, joined)
            except Exception as e:  # this publish only: the exchange still lines up
                log.warning("kvgraft: a publish joined from the pipeline stages failed: %s", e)

    def _send(self, layers: Layers) -> None:
        import torch.distributed as dist

        last = self._leaders[-1]
        ok = len(layers) == self._at.count and layers[0][0].shape[1] > 0  # else "nothing"
        head = torch.tensor(list(layers[0][0].shape) if ok else [0, 0, 0], dtype=torch.int64)
        dist.send(head, dst=last, group=self._group)
        if ok:
            dist.send(torch.stack([t for kv in layers for t in kv]).contiguous(), dst=last,
                      group=self._group)

    def _receive(self, mine: Layers) -> Layers | None:
        import torch.distributed as dist

        joined: Layers = []
        whole = True
        for stage, src in enumerate(self._leaders[:-1]):
            head = torch.empty(3, dtype=torch.int64)
            dist.recv(head, src=src, group=self._group)
            heads, tokens, dim = (int(x) for x in head)
            if tokens == 0:
                whole = False
                continue
            first, end = self._at.spans[stage]
            buf = torch.empty((2 * (end - first), heads, tokens, dim), dtype=self._dtype)
            dist.recv(buf, src=src, group=self._group)
            joined += [(buf[2 * i], buf[2 * i + 1]) for i in range(end - first)]
        if not whole or len(mine) != self._at.count:
            return None
        return joined + mine

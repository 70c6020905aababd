"""The pipeline stages' exchange of a publish's layers (kvgraft.integrations.vllm.stages)
over a real gloo group of two processes, without an engine: the last stage receives every
layer in order; a stage with nothing for a request (a layer short, or no tokens) makes the
last stage publish nothing for it, and neither that nor a publish that fails stops the
requests after it from lining up."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgraft.errors import RegistryError
from kvgraft.integrations.vllm import stages
from tests.support.daemons import free_ports

SPANS = ((0, 2), (2, 3))  # two stages: layers 0-1, then layer 2


def _layers(stage: int) -> stages.Layers:
    first, end = SPANS[stage]
    return [(torch.full((2, 4, 8), float(i)).bfloat16(),
             torch.full((2, 4, 8), float(-i)).bfloat16()) for i in range(first, end)]


def _stage(stage: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=stage,
                            world_size=2)
    got: list[Any] = []

    def joined(token: str, layers: stages.Layers | None) -> None:
        if token == "r4":
            raise RuntimeError("the publish itself fails")  # the exchange goes on
        got.append((token, layers))

    at = stages.Layout(stage, SPANS, leader=True)
    exchange = stages.Exchange(at, stages.leaders_group([0, 1]), torch.bfloat16, joined)
    mine = _layers(stage)
    exchange.submit("r1", mine)
    exchange.submit("r2", mine[:1] if stage == 0 else mine)  # stage 0 lacks a layer
    exchange.submit("r3", [(k[:, :0], v[:, :0]) for k, v in mine])  # no tokens
    exchange.submit("r4", mine)
    exchange.submit("r5", mine)
    exchange.close()
    if at.last:
        Path(out).write_text(json.dumps([
            (token, None if layers is None else
             [(float(k[0, 0, 0]), float(v[0, 0, 0]), list(k.shape)) for k, v in layers])
            for token, layers in got]))
    dist.destroy_process_group()


def test_the_last_stage_joins_every_layer_in_order(tmp_path: Path) -> None:
    out = tmp_path / "joined.json"
    port = free_ports(1)[0]
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=_stage, args=(stage, port, str(out))) for stage in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:  # one still waiting: the exchange lost its order
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    whole = [(float(i), float(-i), [2, 4, 8]) for i in range(3)]
    assert json.loads(out.read_text()) == [["r1", [list(x) for x in whole]], ["r2", None],
                                           ["r3", None], ["r5", [list(x) for x in whole]]]


def test_a_worker_outside_its_stage_layers_is_refused() -> None:
    at = stages.layout(5, [3, 4], 1, 2, leader=False)  # vLLM: 3 layers, then 2
    assert (at.first, at.count, at.last) == (3, 2, True)
    with pytest.raises(RegistryError, match="expected 3-4"):
        stages.layout(5, [2, 3, 4], 1, 2, leader=True)

"""A model's stages in-process, and micro-batches through them (tests/services/test_shard.py checks these
against transformers).

    runners = make_runners(tiny_model, 2)                          # layers [0, 2) and [2, 4), fp32, CPU
    out = through(runners, MicroBatch(1, [chain("r", [5, 6, 7])]))  # nodes 0 -> 1 -> 2 at positions 0, 1, 2
"""
from __future__ import annotations

import torch

from common.batch import MicroBatch, Segment
from services.model.shard import even_split, load_shard
from services.runner import StageRunner

ATOL = 1e-4   # fp32 logits; ours and transformers' differ only by summation order


def chain(rid: str, tokens: list[int], start_node: int = 0, parent: int = -1, start_pos: int = 0,
          want_all: bool = True) -> Segment:
    """A segment of consecutive nodes, each the child of the one before (the first of `parent`)."""
    n = len(tokens)
    nodes = list(range(start_node, start_node + n))
    return Segment(rid, nodes, [parent] + nodes[:-1], list(range(start_pos, start_pos + n)), tokens,
                   [want_all or i == n - 1 for i in range(n)])


def make_runners(path, num_stages: int, layers: int = 4) -> list[StageRunner]:
    """`num_stages` StageRunners over `layers` layers split evenly (fp32, CPU)."""
    return [StageRunner(load_shard(str(path), a, b, torch.float32, "cpu"), i)
            for i, (a, b) in enumerate(even_split(layers, num_stages))]


def through(runners: list[StageRunner], batch: MicroBatch) -> MicroBatch:
    """The micro-batch after every stage, in order (the last stage's output)."""
    for r in runners:
        batch = r.step(batch)
    return batch

"""A model's stages in-process, and micro-batches through them (tests/services/test_shard.py checks these
against transformers).

    runners = make_runners(tiny_model, 2)                          # layers [0, 2) and [2, 4), fp32, CPU
    out = through(runners, MicroBatch(1, [chain("r", [5, 6, 7])]))  # nodes 0 -> 1 -> 2 at positions 0, 1, 2
    results, emits, finishes = play(sched.poll(), runners)          # a scheduler's actions carried out
"""
from __future__ import annotations

import torch

from collections.abc import Iterable

from common.batch import MicroBatch, Segment
from coordinator.core.schedulers.base import Action, Broadcast, Emit, Finish, Inject
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


def play(actions: Iterable[Action], runners: list[StageRunner]) -> tuple[list[MicroBatch], list[Emit], list[Finish]]:
    """Carry a scheduler's actions out on in-process stages, in order: a broadcast is applied to every stage,
    an injected micro-batch goes through them all (its result is returned, in order: the caller hands it back
    to `on_result` when it likes); emits and finishes are returned as they came."""
    results: list[MicroBatch] = []
    emits: list[Emit] = []
    finishes: list[Finish] = []
    for action in actions:
        if isinstance(action, Broadcast):
            for r in runners:
                r.apply(action.control)
        elif isinstance(action, Inject):
            results.append(through(runners, action.batch))
        elif isinstance(action, Emit):
            emits.append(action)
        elif isinstance(action, Finish):
            finishes.append(action)
    return results, emits, finishes

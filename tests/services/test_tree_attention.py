"""Tree attention: for random trees sent in random micro-batch splits, every node's output equals the plain
causal forward of transformers over that node's root path."""
from __future__ import annotations

import random

import pytest
import torch

from helpers.shard import ATOL, chain, make_runners, through
from common.batch import Control, MicroBatch, Segment


def random_tree(rng: random.Random, prefix_last: int, first_id: int, size: int) -> list[tuple[int, int, int]]:
    """(node, parent, token) in topological order; parents drawn from the prefix tip and earlier nodes."""
    nodes: list[tuple[int, int, int]] = []
    for i in range(size):
        parent = rng.choice([prefix_last] + [n for n, _, _ in nodes])
        nodes.append((first_id + i, parent, rng.randrange(3, 256)))
    return nodes


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_match_causal_forward_along_each_path(tiny_model, tiny_hf, seed):
    rng = random.Random(seed)
    num_stages = rng.choice([1, 2, 4])
    runners = make_runners(tiny_model, num_stages)
    prefix = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 8))]
    n = len(prefix)
    for r in runners:
        r.apply(Control("r", commit=list(range(n))))
    through(runners, MicroBatch(0, [chain("r", prefix, want_all=False)]))
    tree = random_tree(rng, n - 1, n, rng.randrange(4, 16))
    parent_of = {node: parent for node, parent, _ in tree}
    token_of = {node: token for node, _, token in tree}
    depth = {n - 1: n - 1}
    for node, parent, _ in tree:
        depth[node] = depth[parent] + 1
    got: dict[int, torch.Tensor] = {}
    i, batch_id = 0, 1
    while i < len(tree):                           # random split into micro-batches, in order
        part = tree[i:i + rng.randrange(1, 5)]
        i += len(part)
        seg = Segment("r", [p[0] for p in part], [p[1] for p in part], [depth[p[0]] for p in part],
                      [p[2] for p in part], [True] * len(part))
        out = through(runners, MicroBatch(batch_id, [seg], return_logprobs=True))
        batch_id += 1
        for j, node in enumerate(out.segments[0].node_ids):
            got[node] = out.logprobs[j]
    assert len(got) == len(tree)
    for node in got:
        path, cur = [], node
        while cur >= n:
            path.append(token_of[cur])
            cur = parent_of[cur]
        with torch.no_grad():
            ref = torch.log_softmax(tiny_hf(torch.tensor([prefix + path[::-1]])).logits[0, -1], -1)
        assert (got[node] - ref).abs().max().item() < ATOL, f"node {node} (seed {seed})"

"""Reductions: the microbatch sums of each summation rule, and which rule a layout takes."""

from __future__ import annotations

import pytest
import torch

from funcshard.layout import determinism
from funcshard.step.reduction import RING, TREE, AddInto, CompleteTree, Fold, KeepSections, Tree


def _values(n: int) -> list[list[torch.Tensor]]:
    # values whose float32 sums depend on the order they are added in
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(64, generator=g) * 10.0 ** (i % 4)] for i in range(n)]


def test_fold_adds_in_arrival_order_into_one_accumulator() -> None:
    fold, values = Fold(), _values(4)
    for k, v in enumerate(values):
        sink = fold.sink(last=k == 3, in_backward=False)
        if sink.acc is None:
            out = [v[0].clone()]
        else:
            sink.acc[0].add_(v[0])  # what a producer does with the sink's buffers
            out = sink.acc
        fold.add(out)
    expected = values[0][0].clone()
    for v in values[1:]:
        expected += v[0]
    assert torch.equal(fold.result()[0], expected)


def test_tree_sums_by_the_pairwise_tree() -> None:
    tree, values = Tree(), _values(8)
    for k, v in enumerate(values):
        sink = tree.sink(last=k == 7, in_backward=False)
        assert sink == AddInto()  # fresh sections every microbatch
        tree.add([v[0].clone()])
    expected = determinism.pairwise_sum([v[0] for v in values])
    assert torch.equal(tree.result()[0], expected)
    left_fold = sum((v[0] for v in values[1:]), values[0][0].clone())
    assert not torch.equal(expected, left_fold)  # the values tell the orders apart


def test_tree_in_backward_keeps_sections_then_completes() -> None:
    tree = Tree()
    first = tree.sink(last=False, in_backward=True)
    assert isinstance(first, KeepSections)
    tree.add([torch.ones(4)])
    last = tree.sink(last=True, in_backward=True)
    assert isinstance(last, CompleteTree) and last.tree is not None
    reduced = [torch.full((2,), 3.0)]  # what the completing microbatch hands back
    tree.add(reduced)
    assert tree.result() is reduced


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_rules(microbatches: int) -> None:
    assert RING.reduces_each_microbatch(microbatches)
    assert isinstance(RING.microbatch_sum(microbatches), Fold)
    assert TREE.reduces_each_microbatch(microbatches) == (microbatches == 1)
    expected = Fold if microbatches == 1 else Tree
    assert isinstance(TREE.microbatch_sum(microbatches), expected)
    assert TREE.sums_uses_first and not RING.sums_uses_first
    RING.check_microbatches(3, microbatches)  # any count sums in arrival order
    with pytest.raises(ValueError, match="power of two"):
        TREE.check_microbatches(3, microbatches)

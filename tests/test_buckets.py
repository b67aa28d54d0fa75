"""funcshard.layout.buckets: PerBucket keeps each bucket's Members off the leaves, through tree
maps.

The optimizer state that ``tree.map`` builds from a PerBucket of master buffers is again a
PerBucket with the same members: that is how checkpoints and the offloaded step find the
per-bucket parts of any optimizer state. Entries may be None (a bucket an inner optimizer of
``multi_transform`` does not own).
"""

from __future__ import annotations

import pickle

import optree
import pytest
import torch

import funcshard as fs
from funcshard.layout.buckets import NAMESPACE, Members, PerBucket, is_per_bucket

MEMBERS = (Members(("a", "b"), ((2, 3), ())), Members(("c",), ((4,),)))


def _per_bucket() -> PerBucket:
    return PerBucket([torch.arange(7.0), torch.arange(4.0)], MEMBERS)


def test_members_are_static_and_survive_a_tree_map() -> None:
    pb = _per_bucket()
    leaves, spec = optree.tree_flatten(pb, namespace=NAMESPACE)
    assert len(leaves) == 2  # the members are no leaves
    moments = fs.tree.map(torch.zeros_like, {"mu": pb, "count": torch.zeros(())})
    assert is_per_bucket(moments["mu"]) and moments["mu"].members == MEMBERS
    assert all(torch.equal(m, torch.zeros_like(t)) for m, t in zip(moments["mu"], pb, strict=True))
    again = optree.tree_unflatten(spec, leaves)
    assert is_per_bucket(again) and again.members == MEMBERS
    # Two PerBuckets with other members have other tree structures.
    other = PerBucket(list(pb), (MEMBERS[1], MEMBERS[0]))
    assert optree.tree_structure(other, namespace=NAMESPACE) != spec


def test_a_bucket_without_a_value_is_none_and_no_leaf() -> None:
    pb = PerBucket([None, torch.ones(4)], MEMBERS)
    assert optree.tree_leaves(pb, namespace=NAMESPACE) == [pb[1]]
    doubled = fs.tree.map(lambda x: 2 * x, pb)
    assert doubled[0] is None and torch.equal(doubled[1], 2 * torch.ones(4))
    assert doubled.members == MEMBERS


def test_select_and_pickle_keep_the_members() -> None:
    pb = _per_bucket()
    one = pb.select([1])
    assert one.members == (MEMBERS[1],) and torch.equal(one[0], pb[1])
    back = pickle.loads(pickle.dumps(pb))
    assert is_per_bucket(back) and back.members == MEMBERS
    assert all(torch.equal(a, b) for a, b in zip(back, pb, strict=True))
    assert MEMBERS[0].pairs() == (("a", (2, 3)), ("b", ()))


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="1 entries for 2 members"):
        PerBucket([torch.zeros(1)], MEMBERS)
    with pytest.raises(ValueError, match="2 names for 1 shapes"):
        Members(("a", "b"), ((1,),))

"""funcshard.layout.layout: rows per shard rank, buckets, units, offload choice, the same on
every rank.

The layout is computed from parameter shapes and the mesh shape alone: these tests build it on
2 and 4 gloo ranks (meshes 2, 1x4, 2x2 and 4x1) and compare what each rank derived, and check
the pure parts (units, tied names, the offload choice, row ranges) in this process.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import funcshard as fs
from funcshard.layout import build as build_lib
from funcshard.layout import layout as layout_lib
from funcshard.layout.buckets import Members
from funcshard.layout.layout import LeafSpec
from funcshard.layout.offload_choice import pick_offloaded

import models

FP32 = fs.MixedPrecisionPolicy()
SHAPES = {"a": (37, 5), "b": (7,), "s": (), "c": (3, 4, 2), "d": (1, 9)}


def _params(shapes: dict, dtype: torch.dtype = torch.float32) -> dict:
    return {n: (s, dtype) for n, s in shapes.items()}


def _summary(layout: layout_lib.Layout) -> dict:
    """What a rank derived, in picklable form."""
    return {
        "leaves": layout.leaves,
        "buckets": layout.buckets,
        "units": layout.units,
        "shard_size": layout.shard_size,
        "shard_rank": layout.shard_rank,
        "dp_size": layout.dp_size,
        "rows": {s.name: [s.row_range(r) for r in range(layout.shard_size)] for s in layout.leaves},
    }


def layouts_worker(shard: int, replicate: int) -> dict:
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    build = lambda **kw: build_lib.build_layout(
        _params(SHAPES), model=None, mesh=mesh, policy=FP32, **kw
    )
    return {s: _summary(build(strategy=s)) for s in fs.STRATEGIES}


@pytest.mark.parametrize("mesh", [(4, 1), (2, 2), (1, 4)], ids=["shard4", "shard2_rep2", "rep4"])
def test_rows_are_split_evenly_padded_and_the_same_on_every_rank(pool4, mesh) -> None:
    shard, replicate = mesh
    results = pool4.run(layouts_worker, shard, replicate)
    for strategy in fs.STRATEGIES:
        size = 1 if strategy == "no_shard" else shard
        first = results[0][strategy]
        for rank, r in enumerate(results):
            got = r[strategy]
            # Every rank derives the same leaves and buckets without communicating.
            assert got["leaves"] == first["leaves"] and got["buckets"] == first["buckets"]
            assert got["shard_size"] == size and got["dp_size"] == 4
            assert got["shard_rank"] == (0 if strategy == "no_shard" else rank % shard)
        for spec in first["leaves"]:
            shape = SHAPES[spec.name]
            rows = shape[0] if shape else 1  # a 0-d parameter is one row
            assert spec.rows == rows and spec.row_numel == math.prod(shape[1:])
            assert spec.rows_per_shard == -(-rows // size), spec
            ranges = first["rows"][spec.name]
            # The real rows, in order, each owned by exactly one shard rank.
            assert [i for a, b in ranges for i in range(a, b)] == list(range(rows)), ranges
            assert all(b - a <= spec.rows_per_shard for a, b in ranges)


def test_leaves_of_one_bucket_are_packed_back_to_back() -> None:
    specs, offset = [], 0
    for i, (rows, rps, row_numel) in enumerate([(37, 10, 5), (7, 2, 1), (1, 1, 1)]):
        specs.append(LeafSpec(f"p{i}", (rows, row_numel), None, 0, rows, rps, row_numel, 0, offset))
        offset += rps * row_numel
    assert [s.shard_numel for s in specs] == [50, 2, 1]
    assert [s.offset for s in specs] == [0, 50, 52]
    assert specs[0].row_range(3) == (30, 37)  # the last rank's rows stop at the real ones
    assert specs[0].shard_shape(3) == (7, 5)
    assert specs[0].row_range(4) == (37, 37) and specs[0].shard_shape(4) == (0, 5)


def test_a_0d_leaf_is_held_whole_by_the_first_shard_rank() -> None:
    spec = LeafSpec("s", (), None, 0, 1, 1, 1, 0, 0)
    assert spec.numel == 1
    assert spec.shard_shape(0) == () and spec.shard_shape(1) == (0,)


def buckets_worker() -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    names = dict(model.named_parameters())
    params = {n: (tuple(p.shape), p.dtype) for n, p in names.items()}
    params["blocks.1.fc.bias"] = (params["blocks.1.fc.bias"][0], torch.float64)
    build = lambda **kw: build_lib.build_layout(
        params, model=model, mesh=mesh, policy=FP32, strategy="optim_grads_params", **kw
    )
    matrices = lambda name, shape: len(shape) == 2  # a rule key per optimizer rule
    out = {}
    for key, kw in {
        "plain": {},
        "partitioned": {"partition": matrices},
        "offload": {"offload_fraction": 0.5},
        "units": {"units": ["blocks.0", "head"]},
    }.items():
        layout = build(**kw)
        out[key] = {
            "units": layout.units,
            "buckets": [
                (b.unit, b.offload, b.dtypes.model, [layout.leaves[i].name for i in b.leaves])
                for b in layout.buckets
            ],
            "numel": [b.numel for b in layout.buckets],
            "packed": [sum(layout.leaves[i].shard_numel for i in b.leaves) for b in layout.buckets],
            "offsets_ok": all(
                [layout.leaves[i].offset for i in b.leaves]
                == [
                    sum(layout.leaves[j].shard_numel for j in b.leaves[:k])
                    for k in range(len(b.leaves))
                ]
                for b in layout.buckets
            ),
            "achieved": layout.achieved_offload_fraction(),
            "names": layout.names,
            "members": layout.members,
        }
    return out


def test_buckets_group_a_units_leaves_by_dtypes_placement_and_rule(pool2) -> None:
    r = pool2.run(buckets_worker)[0]
    model = models.make_model()
    order = [n for n, _ in model.named_parameters()]
    for key, got in r.items():
        assert list(got["names"]) == order, key  # named_parameters order
        assert got["numel"] == got["packed"] and got["offsets_ok"], key
        flat = [n for *_, names in got["buckets"] for n in names]
        assert sorted(flat) == sorted(order), key  # every leaf in exactly one bucket
        for unit, _, _, names in got["buckets"]:
            prefix = got["units"][unit]
            assert all(n.startswith(prefix + ".") for n in names) if prefix else True, names
            assert names == [n for n in order if n in names], names  # model order inside
        assert [m.names for m in got["members"]] == [tuple(b[3]) for b in got["buckets"]]
    plain = r["plain"]
    # Default units: the children of the ModuleList; the rest is the root unit "".
    assert plain["units"] == ("", "blocks.0", "blocks.1", "blocks.2")
    # The fp64 bias gets its own bucket in its unit; everything else of a unit shares one.
    assert [(u, names) for u, _, _, names in plain["buckets"]] == [
        (0, ["scale", "inp.weight", "inp.bias", "head.weight", "head.bias"]),
        (
            1,
            [
                "blocks.0.norm.weight",
                "blocks.0.norm.bias",
                "blocks.0.fc.weight",
                "blocks.0.fc.bias",
            ],
        ),
        (2, ["blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.fc.weight"]),
        (2, ["blocks.1.fc.bias"]),
        (
            3,
            [
                "blocks.2.norm.weight",
                "blocks.2.norm.bias",
                "blocks.2.fc.weight",
                "blocks.2.fc.bias",
            ],
        ),
    ]
    for _, _, _, names in r["partitioned"]["buckets"]:  # one rule per flat buffer
        assert len({n.endswith("weight") and "norm" not in n for n in names}) == 1, names
    assert r["units"]["units"] == ("", "blocks.0", "head")
    offloaded = [b for b in r["offload"]["buckets"] if b[1]]
    assert offloaded and len(offloaded) < len(r["offload"]["buckets"])
    assert 0.3 < r["offload"]["achieved"] < 0.7 and plain["achieved"] == 0.0


def errors_worker() -> list[str]:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model()
    params = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    cases = [
        dict(params=params, strategy="zero9"),
        dict(params=params, strategy="optim", offload_fraction=1.5),
        dict(params={**params, "steps": ((3,), torch.int64)}, strategy="optim"),
        dict(params=params, strategy="optim", model=model, units=["blocks.7"]),
        dict(params=params, strategy="optim", deterministic=True),
    ]
    messages = []
    for case in cases:
        p = case.pop("params")
        kw = {"model": None, "mesh": mesh, "policy": FP32, **case}
        if "deterministic" in case:
            kw["policy"] = fs.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)
        try:
            build_lib.build_layout(p, **kw)
            messages.append("no error")
        except (ValueError, TypeError) as e:
            messages.append(f"{type(e).__name__}: {e}")
    layout = build_lib.build_layout(params, model=None, mesh=mesh, policy=FP32, strategy="optim")
    for lookup in (
        lambda: layout.leaf("nope"),
        lambda: layout.placement.leaves(Members(("x",), ((1,),))),
    ):
        try:
            lookup()
            messages.append("no error")
        except KeyError as e:
            messages.append(f"KeyError: {e}")
    return messages


def test_bad_inputs_raise_and_say_what_was_expected(pool2) -> None:
    unknown, fraction, dtype, units, comm, leaf, members = pool2.run(errors_worker)[0]
    assert unknown.startswith("ValueError") and "'zero9'" in unknown and "optim_grads" in unknown
    assert fraction.startswith("ValueError") and "[0, 1]" in fraction and "1.5" in fraction
    assert dtype.startswith("TypeError") and "'steps'" in dtype and "floating" in dtype
    assert units.startswith("ValueError") and "blocks.7" in units
    assert comm.startswith("ValueError") and "grad_comm_dtype" in comm
    assert leaf.startswith("KeyError") and "nope" in leaf
    assert members.startswith("KeyError") and "['x']" in members


def aligned_worker() -> list:
    mesh = fs.make_mesh(device_type="cpu")
    layout = build_lib.build_layout(
        _params(SHAPES), model=None, mesh=mesh, policy=FP32, strategy="optim", deterministic=True
    )
    return [(s.name, s.shard_numel, s.offset, s.rows_per_shard) for s in layout.leaves]


def test_deterministic_layouts_align_every_shard_to_32_elements(pool2) -> None:
    for name, shard_numel, offset, rps in pool2.run(aligned_worker)[0]:
        assert shard_numel % build_lib.DETERMINISTIC_ALIGN == 0, name
        assert offset % build_lib.DETERMINISTIC_ALIGN == 0, name
        rows = SHAPES[name][0] if SHAPES[name] else 1
        assert rps >= -(-rows // 2), name  # still holds all its rows


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)])), nn.ReLU()]
        )
        self.extra = nn.ModuleDict({"heads": nn.ModuleList([nn.Linear(2, 1), nn.Linear(2, 1)])})


def test_default_units_are_the_module_list_children_with_params() -> None:
    # A nested ModuleList does not split its unit; a child without params is no unit.
    assert layout_lib.default_units(_Nested()) == ["layers.0", "extra.heads.0", "extra.heads.1"]
    assert layout_lib.default_units(nn.Linear(2, 2)) == []
    # torchtitan's blocks: a ModuleDict keyed "0", "1", ... (a pipeline split keeps the keys)
    blocks = nn.ModuleDict({"0": nn.Linear(2, 2), "3": nn.Linear(2, 2), "7": nn.ReLU()})
    titan = nn.ModuleDict({"emb": nn.Embedding(5, 2), "layers": blocks, "head": nn.Linear(2, 5)})
    assert layout_lib.default_units(titan) == ["layers.0", "layers.3"]


def test_tied_aliases_name_the_names_named_parameters_drops() -> None:
    model = nn.ModuleDict({"emb": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    model["head"].weight = model["emb"].weight
    assert layout_lib.tied_aliases(model) == (("head.weight", "emb.weight"),)
    assert layout_lib.tied_aliases(models.make_model()) == ()


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=12),
    fraction=st.floats(min_value=0.0, max_value=1.0),
)
def test_offloaded_leaves_land_within_half_a_leaf_of_the_fraction(sizes, fraction) -> None:
    chosen = pick_offloaded(sizes, fraction)
    assert chosen == pick_offloaded(list(sizes), fraction)  # deterministic
    assert chosen <= set(range(len(sizes)))
    if fraction >= 1:
        assert chosen == set(range(len(sizes)))
        return
    target = fraction * sum(sizes)
    left = [sizes[i] for i in range(len(sizes)) if i not in chosen and sizes[i] > 0]
    if left:
        assert abs(sum(sizes[i] for i in chosen) - target) <= min(left) / 2
    if fraction == 0:
        assert chosen == set()

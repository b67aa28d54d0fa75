"""Properties on random parameter trees (0-d leaves, single rows, prime sizes, bf16) on 2, 3 and 4
ranks: shard then gather, init then ``full_params``, and save on one layout then restore on
another (strategy, replicas, offload fraction) are the identity.

Hypothesis draws ``FUNCSHARD_PROPERTY_EXAMPLES`` trees per world size (8 by default),
derandomized so CI sees the same cases every run::

    FUNCSHARD_PROPERTY_EXAMPLES=200 python -m pytest -q tests/test_properties.py
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import funcshard as fs

from helpers_errors import cpu_params

PRIMES = (2, 3, 5, 7, 11, 13)


class TreeModel(nn.Module):
    """A module holding a random tree of parameters; the loss is a weighted sum of squares."""

    def __init__(
        self, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], gen: torch.Generator
    ) -> None:
        super().__init__()
        self.sub = nn.Module()
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            owner = self.sub if i % 2 else self
            owner.register_parameter(
                f"w{i}", nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p.float() ** 2).sum() for p in self.parameters()) * x.mean()


ROWS_CHOICES = (1, 2, *PRIMES, 37)
_rows = st.sampled_from(ROWS_CHOICES)
_prime = st.sampled_from(PRIMES)
_shape = st.one_of(
    st.just(()),
    st.tuples(_rows),
    st.tuples(_rows, _prime),
    st.tuples(st.just(1), _prime),
    st.tuples(_rows, st.just(1), st.sampled_from((2, 3))),
)
TREES = st.lists(
    st.tuples(_shape, st.sampled_from(("float32", "float32", "bfloat16"))), min_size=1, max_size=5
)
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("FUNCSHARD_PROPERTY_EXAMPLES", "8")),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _tree_model(leaves: list[tuple[tuple[int, ...], str]], seed: int) -> TreeModel:
    gen = torch.Generator().manual_seed(seed)
    return TreeModel(
        [shape for shape, _ in leaves], [getattr(torch, dtype) for _, dtype in leaves], gen
    )


_MESHES: dict[int, object] = {}


def _mesh(replicate: int):
    if replicate not in _MESHES:
        _MESHES[replicate] = fs.make_mesh(replicate=replicate, device_type="cpu")
    return _MESHES[replicate]


def _gather_rows(local: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict:
    """Full tensors from every rank's rows (mesh with replicate=1, rank order = row order)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in local.items()})
    out = {}
    for n, shape in shapes.items():
        rows = [p[n].reshape(-1, *shape[1:]) if shape else p[n].reshape(-1) for p in parts]
        out[n] = torch.cat(rows).reshape(shape)
    return out


def _rows_of(full: torch.Tensor, spec, shard_rank: int) -> torch.Tensor:
    """The rows of ``full`` that ``shard_rank`` owns under ``spec``, flattened."""
    lo, hi = spec.row_range(shard_rank)
    return full.reshape(max(spec.rows, 1), -1)[lo:hi].reshape(-1)


def shard_gather_case(leaves: list, seed: int, strategy: str) -> bool:
    """fs.shard then gather, and fs.init then fs.full_params, are the identity."""
    model = _tree_model(leaves, seed)
    full = {n: p.detach() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in full.items()}
    local = fs.shard(full, _mesh(1), strategy=strategy)
    if strategy == "no_shard":  # every rank holds every param whole, 0-d ones included
        assert all(tuple(t.shape) == shapes[n] for n, t in local.items())
        back = local
    else:
        back = _gather_rows(local, shapes)
    for n in full:
        assert torch.equal(back[n], full[n]), f"shard/gather changed {n} {shapes[n]}"
    state = fs.init(model, fs.optim.sgd(0.1), mesh=_mesh(1), strategy=strategy)
    for n, t in fs.full_params(state).items():
        assert t.dtype == full[n].dtype and torch.equal(t, full[n]), f"init changed {n}"
    return True


def roundtrip_case(
    leaves: list, seed: int, a: str, b: str, replicate: int, offload: float, path: str
) -> bool:
    """Save on one layout, restore on another: params, optimizer state and step survive."""
    world = dist.get_world_size()
    replicate = replicate if world % replicate == 0 else 1
    model = _tree_model(leaves, seed)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=_mesh(1), strategy=a)
    batch = {"x": torch.ones(2)}
    loss_fn = lambda p, bt, m=model: fs.functional_call(m, p, (bt["x"],))  # noqa: E731
    state, _ = fs.train_step(state, batch, loss_fn)
    shapes = {s.name: s.shape for s in state.layout.leaves}
    full = cpu_params(fs.full_params(state))
    opt = state.opt_state_by_name()
    moments = {
        k: (dict(getattr(opt, k)) if a == "no_shard" else _gather_rows(getattr(opt, k), shapes))
        for k in ("mu", "nu")
    }
    fs.save(path, state)
    like = fs.init(
        model, fs.optim.adamw(1e-2), mesh=_mesh(replicate), strategy=b, offload_fraction=offload
    )
    restored = fs.restore(path, like=like)
    assert restored.step == state.step == 1
    for n, t in fs.full_params(restored).items():
        assert torch.equal(t, full[n]), f"{a} -> {b}: {n} {shapes[n]} changed"
    ropt = restored.opt_state_by_name()
    assert ropt.count == opt.count
    for spec in restored.layout.leaves:
        for k in ("mu", "nu"):
            got = getattr(ropt, k)[spec.name].cpu().reshape(-1)
            want = _rows_of(moments[k][spec.name], spec, restored.layout.shard_rank)
            assert torch.equal(got, want.to(got.dtype)), f"{a} -> {b}: {k}.{spec.name} changed"
    return True


@pytest.mark.parametrize("pool_name", ["pool2", "pool3", "pool4"])
@PROPERTY_SETTINGS
@given(leaves=TREES, seed=st.integers(0, 2**16), strategy=st.sampled_from(fs.STRATEGIES))
def test_shard_then_gather_is_the_identity(request, pool_name, leaves, seed, strategy):
    pool = request.getfixturevalue(pool_name)
    assert pool.run(shard_gather_case, leaves, seed, strategy) == [True] * pool.nproc


@pytest.mark.parametrize("pool_name", ["pool2", "pool3", "pool4"])
@PROPERTY_SETTINGS
@given(
    leaves=TREES,
    seed=st.integers(0, 2**16),
    a=st.sampled_from(fs.STRATEGIES),
    b=st.sampled_from(fs.STRATEGIES),
    replicate=st.sampled_from((1, 2)),
    offload=st.sampled_from((0.0, 0.5, 1.0)),
)
def test_save_then_restore_on_another_layout_is_the_identity(
    request, pool_name, leaves, seed, a, b, replicate, offload
):
    pool = request.getfixturevalue(pool_name)
    path = os.path.join(tempfile.mkdtemp(prefix="funcshard-prop-"), "ckpt")
    try:
        assert (
            pool.run(roundtrip_case, leaves, seed, a, b, replicate, offload, path)
            == [True] * pool.nproc
        )
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)

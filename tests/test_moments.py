"""Precision-aware optimizer state: ``mu_dtype`` / ``nu_dtype`` (bf16, fp16, 8-bit blockwise).

Moments are stored narrow and the update runs in fp32: dtypes and bytes (plan = measured),
numerics against an fp32-moment reference within stated bounds, TrainState / offload / Muon /
chains, bitwise determinism across layouts, and checkpoint conversion between moment dtypes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard.layout.buckets import Ragged
from funcshard.layout.parts import StateParts
from funcshard.optim.moments import MomentFormat, block_of

BF16, I8, U8 = torch.bfloat16, torch.int8, torch.uint8


class Wide(nn.Module):
    """Leaves that take 8-bit moments (rows of 64, 75 rows: uneven over 2 and 4 ranks; 37 rows
    of 300: blocks of 256 and 44; 37 rows of 129: one block a row) beside ones that keep fp32
    (biases, a 5-column input, 11-row heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 64)
        self.fc = nn.Linear(64, 64)
        self.up = nn.Linear(64, 75)
        self.head = nn.Linear(75, 11)
        self.mid = nn.Linear(64, 300, bias=False)
        self.rag = nn.Linear(300, 37)  # (37, 300): ragged blocks
        self.wid = nn.Linear(64, 129, bias=False)
        self.odd = nn.Linear(129, 37)  # (37, 129): one block of 129 a row
        self.out = nn.Linear(37, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.fc(h))
        side = torch.tanh(self.rag(torch.tanh(self.mid(h)))) + torch.tanh(
            self.odd(torch.tanh(self.wid(h)))
        )
        return self.head(torch.tanh(self.up(h))) + self.out(side)


def make_model(seed: int = 0) -> Wide:
    torch.manual_seed(seed)
    return Wide()


def batch(step: int, rows: int = 16) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {"x": torch.randn(rows, 5, generator=g), "y": torch.randint(0, 11, (rows,), generator=g)}


def loss_fn_of(model: nn.Module):
    def loss_fn(params, b):
        return nn.functional.cross_entropy(fs.functional_call(model, params, (b["x"],)), b["y"])

    return loss_fn


def _adamw(mu=None, nu=None, **kw) -> fs.optim.Optimizer:
    return fs.optim.adamw(1e-2, weight_decay=0.1, mu_dtype=mu, nu_dtype=nu, **kw)


# --- formats ---------------------------------------------------------------------------------
def test_block_rule() -> None:
    assert block_of((75, 64)) == 64 and block_of((1024, 768)) == 256
    assert block_of((64, 5)) is None and block_of((4096,)) is None and block_of((8, 64)) is None
    # any row length: a short row is one block, a long one ends in a shorter block
    assert block_of((37, 129)) == 129 and block_of((4096, 1)) == 1
    assert block_of((256, 769)) == Ragged(256, 769) and block_of((16, 300)) == Ragged(256, 300)


@pytest.mark.parametrize("dtype", [I8, U8])
def test_8bit_ragged_rows_within_a_block_step(dtype: torch.dtype) -> None:
    """Rows of 769 in blocks of 256, 256, 256 and 1: each block scaled by its own absmax (the
    round trip within absmax/100 of its own block; a row's last element is its own scale)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 769, generator=g) * torch.logspace(-6, 0, 769)
    x = x.square() if dtype == U8 else x
    fmt = MomentFormat(dtype, block_of(x.shape))
    values, scales = fmt.zeros(x.view(-1))
    assert scales.shape == (12 * 4,)
    fmt.encode(x.reshape(-1).clone(), values, scales)
    back = fmt.decode(values, scales, torch.empty(x.numel())).view_as(x)
    a = torch.cat([x[:, k : k + 256].abs().amax(1, keepdim=True) for k in (0, 256, 512, 768)], 1)
    torch.testing.assert_close(scales.view(12, 4), a, rtol=0, atol=0)
    per_element = torch.cat([a[:, :3].repeat_interleave(256, 1), a[:, 3:]], 1)
    assert ((back - x).abs() <= per_element / 100).all()
    # its own absmax: back to itself but for the decode's fp32 roundings (factor, products)
    torch.testing.assert_close(back[:, 768], x[:, 768], rtol=2.0**-21, atol=0)


@pytest.mark.parametrize("dtype", [I8, U8])
def test_8bit_round_trip_within_a_block_step(dtype: torch.dtype) -> None:
    """decode(encode(x)) is within absmax/100 of x for every element of its block (the
    companding step is at most 2 * 0.5/127 of absmax at the top of the range)."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-6, 0, 64).unsqueeze(1)
    x = x.square() if dtype == U8 else x
    fmt = MomentFormat(dtype, 256)
    values, scales = fmt.zeros(x.view(-1))
    fmt.encode(x.reshape(-1).clone(), values, scales)
    back = torch.empty(x.numel())
    fmt.decode(values, scales, back)
    absmax = x.abs().amax(1, keepdim=True)
    assert values.dtype == dtype and scales.shape == (64,)
    assert ((back.view_as(x) - x).abs() <= absmax / 100).all()
    torch.testing.assert_close(scales, absmax.squeeze(1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [I8, U8])
def test_8bit_tiny_blocks_keep_the_formats_error(dtype: torch.dtype) -> None:
    """Blocks of any magnitude keep that bound, relative to their own absmax: ``top / absmax``
    overflows fp32 below absmax ~1e-29 (uint8's top is 255^4) and ~5e-35 (int8's 127^2),
    and ``absmax / top`` turns subnormal; such blocks came back as zeros. Absmax 1e-20 to
    1e-45 (fp32's subnormals), an all-zero block; zeros stay zero, nothing is NaN or inf.
    The decoded value's own rounding to a multiple of 2^-149 is added to the bound."""
    absmax = torch.tensor([1.0, 1e-20, 1e-30, 1e-33, 1e-36, 3e-38, 1e-40, 1e-45, 0.0])
    x = torch.randn(len(absmax), 256, generator=torch.Generator().manual_seed(0))
    x = x.abs() if dtype == U8 else x
    x[:, ::9] = 0.0
    x = x / x.abs().amax(1, keepdim=True) * absmax.unsqueeze(1)
    fmt = MomentFormat(dtype, 256)
    values, scales = fmt.zeros(x.view(-1))
    fmt.encode(x.reshape(-1).clone(), values, scales)
    back = fmt.decode(values, scales, torch.empty(x.numel())).view_as(x)
    a = x.abs().amax(1, keepdim=True)
    assert back.isfinite().all() and (back[x == 0] == 0).all() and (back[-1] == 0).all()
    assert ((back - x).abs() <= a / 100 + 2.0**-150).all()
    assert (back[:-1] != 0).sum(1).min() > 0  # every block with a nonzero kept one


# --- plain trees: numerics against fp32 moments ------------------------------------------------
def _trajectory(opt, steps: int = 30) -> dict:
    torch.manual_seed(1)
    shapes = {"w": (64, 128), "b": (128,), "e": (96, 64)}
    p = {k: torch.randn(s) for k, s in shapes.items()}
    s = opt.init(p)
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        grads = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in p.items()}
        p, s = opt.update(grads, s, p)
    return p, s


def test_explicit_fp32_moments_are_the_plain_bits() -> None:
    """The chunked decode/step/encode loop runs torch's fused kernel: fp32 storage = None."""
    want, _ = _trajectory(_adamw())
    got, _ = _trajectory(_adamw(torch.float32, torch.float32))
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize(
    "mu,nu,stochastic,bound",
    [
        (BF16, BF16, False, 0.01),
        (BF16, BF16, True, 0.01),
        (torch.float16, BF16, False, 0.01),
        (I8, U8, False, 0.03),
    ],
)
def test_adamw_against_fp32_moments(mu, nu, stochastic, bound) -> None:
    """30 steps of lr 1e-2 move a param by up to 0.3; narrow moments stay within ``bound``
    of the fp32-moment trajectory (bf16: 1/30 of the way; 8-bit: 1/10) and differ from it."""
    want, _ = _trajectory(_adamw())
    got, state = _trajectory(_adamw(mu, nu, stochastic_rounding=stochastic))
    assert state.mu["w"].dtype == mu and state.nu["w"].dtype == nu
    err = max((got[k] - want[k]).abs().max().item() for k in want)
    assert 0 < err < bound, err
    if mu == I8:
        assert state.mu["b"].dtype == torch.float32 and state.mu_scale["b"] is None
        assert state.mu_scale["w"].shape == (64 * 128 // 128,)


def test_sgd_momentum() -> None:
    want, _ = _trajectory(fs.optim.sgd(0.1, momentum=0.9))
    for dtype, bound in [(BF16, 0.02), (I8, 0.1)]:  # params move by up to 1.5
        got, state = _trajectory(fs.optim.sgd(0.1, momentum=0.9, mu_dtype=dtype))
        assert state.momentum["w"].dtype == dtype
        err = max((got[k] - want[k]).abs().max().item() for k in want)
        assert 0 < err < bound, (dtype, err)


def _muon_trajectory(opt, steps: int = 10) -> tuple[dict, dict, object]:
    torch.manual_seed(0)
    start = {"w": torch.randn(64, 128) * 0.1, "e": torch.randn(96, 64) * 0.1}
    p, s = {k: v.clone() for k, v in start.items()}, opt.init(start)
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        p, s = opt.update({k: torch.randn(v.shape, generator=g) for k, v in p.items()}, s, p)
    return start, p, s


@pytest.mark.parametrize("dtype,bound", [(BF16, 1 / 30), (torch.float16, 1 / 30), (I8, 1 / 10)])
def test_muon_momentum_stored_narrow_over_steps(dtype, bound) -> None:
    """10 Muon steps with the momentum stored narrow (from the second step on the update
    decodes it: lerp(g, buf, 0.95) weighs the stored buffer 19 to 1) stay within ``bound`` of
    the distance the fp32-momentum run moved (as AdamW's: bf16 / fp16 1/30, 8-bit 1/10; the
    moment's rounding, 2^-9 / 2^-12 relative or 1/254 of a block's absmax, is finer than the
    bf16 Newton-Schulz's own, which sets the error), and differ from it. A run that lost its
    momentum between steps (momentum=0) ends over three times that far off."""
    start, want, _ = _muon_trajectory(fs.optim.muon(0.02))
    moved = max((want[k] - start[k]).abs().max().item() for k in want)
    off = lambda got: max((got[k] - want[k]).abs().max().item() for k in want) / moved  # noqa: E731
    _, got, state = _muon_trajectory(fs.optim.muon(0.02, mu_dtype=dtype))
    assert {v.dtype for v in state.momentum.values()} == {dtype}
    assert 0 < off(got) < bound, off(got)
    _, forgot, _ = _muon_trajectory(fs.optim.muon(0.02, momentum=0.0))
    assert off(forgot) > 3 * bound, off(forgot)  # the bound tells momentum from none


def test_bad_dtypes_raise() -> None:
    with pytest.raises(ValueError, match="nu_dtype"):
        fs.optim.adamw(nu_dtype=torch.int8)
    with pytest.raises(ValueError, match="mu_dtype"):
        fs.optim.adamw(mu_dtype=torch.uint8)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        fs.optim.adamw(mu_dtype=I8, stochastic_rounding=True)


# --- TrainState: dtypes, bytes (plan = measured), chains, masks, multi_transform ----------------
def _state_bytes(state) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in fs.tree.leaves(state.opt_state)
        if isinstance(t, torch.Tensor)
    )


def _recipe(mu, nu, sr: bool = False) -> fs.optim.Optimizer:
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(0.3),
        fs.optim.multi_transform(
            {
                "muon": fs.optim.muon(0.02, mu_dtype=mu),
                "adamw": _adamw(mu, nu, mask=fs.optim.decay_mask, stochastic_rounding=sr),
            },
            lambda name, shape: "muon" if name == "fc.weight" else "adamw",
        ),
    )


@pytest.mark.parametrize(
    "mu,nu,per_param", [(None, None, 8.0), (BF16, BF16, 4.0), (I8, U8, 2.125)]
)  # 8-bit: one scale per <= 129 elements
def test_state_dtypes_and_bytes(pool1, mu, nu, per_param) -> None:
    pool1.run(_state_worker, mu, nu, per_param)


def _state_worker(mu, nu, per_param) -> None:
    mesh = fs.make_mesh(device_type="cpu")
    model = make_model()
    opt = _adamw(mu, nu)
    state = fs.init(model, opt, mesh=mesh, strategy="optim")
    p = fs.plan(model, world_size=1, strategy="optim", optimizer=opt)
    assert p.memory.opt_state == _state_bytes(state)
    moments = state.opt_state_by_name()
    eight = {n for n, q in model.named_parameters() if block_of(tuple(q.shape))}
    assert eight == {
        "fc.weight",
        "up.weight",
        "mid.weight",
        "rag.weight",
        "wid.weight",
        "odd.weight",
    }
    for name in eight:
        assert moments.mu[name].dtype == (mu or torch.float32)
        assert moments.nu[name].dtype == (nu or torch.float32)
    big = sum(model.get_parameter(n).numel() for n in eight)
    big_bytes = sum(
        t.numel() * t.element_size()
        for part in (moments.mu, moments.nu, moments.mu_scale or {}, moments.nu_scale or {})
        for n, t in part.items()
        if n in eight
    )
    assert big_bytes / big <= per_param
    if mu == I8:
        assert moments.mu_scale["up.weight"].shape == (75, 1)
        assert moments.mu_scale["rag.weight"].shape == moments.nu_scale["rag.weight"].shape
        assert moments.nu_scale["rag.weight"].shape == (37, 2)  # 256 + 44
        assert moments.mu_scale["odd.weight"].shape == (37, 1)
    # a recipe with chains, masks, multi_transform and Muon: plan = measured too, and it steps
    state = fs.init(model, _recipe(mu, nu), mesh=mesh, strategy="optim_grads_params")
    p = fs.plan(model, world_size=1, strategy="optim_grads_params", optimizer=_recipe(mu, nu))
    assert p.memory.opt_state == _state_bytes(state)
    loss_fn = loss_fn_of(model)
    for step in range(3):
        state, m = fs.train_step(state, batch(step), loss_fn)
        assert math.isfinite(m["loss"])


# --- determinism: bitwise across layouts with narrow moments ------------------------------------
def _det_worker(strategy: str, fraction: float, mu, nu, sr: bool = False) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(3)
    state = fs.init(
        model,
        _recipe(mu, nu, sr),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy=strategy,
        offload_fraction=fraction,
        deterministic=True,
    )
    loss_fn = loss_fn_of(model)
    for step in range(3):
        b = {k: v.chunk(world)[rank] for k, v in batch(step).items()}
        state, _ = fs.train_step(state, b, loss_fn, microbatches=4 // world)
    full = fs.full_params(state)
    return {k: v.clone() for k, v in full.items()}


@pytest.mark.parametrize("mu,nu,sr", [(BF16, BF16, False), (BF16, BF16, True), (I8, U8, False)])
def test_deterministic_across_layouts(pool1, pool2, mu, nu, sr) -> None:
    want = pool1.run(_det_worker, "optim_grads_params", 0.0, mu, nu, sr)[0]
    for strategy, fraction in [("optim_grads_params", 0.0), ("optim", 0.5)]:
        for got in pool2.run(_det_worker, strategy, fraction, mu, nu, sr):
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert not differ, (strategy, fraction, differ)


# --- checkpoints: stored as they are, restored across moment dtypes -----------------------------
def _buffer_sizes(state: fs.TrainState) -> list[tuple[int, torch.dtype]]:
    leaves = [*state.master, *fs.tree.leaves(state.opt_state)]
    return [(t.numel(), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]


def _ckpt_worker(tmp: str) -> None:
    mesh = fs.make_mesh(device_type="cpu")
    model = make_model(5)
    loss_fn = loss_fn_of(model)

    def trained(mu, nu):
        state = fs.init(model, _adamw(mu, nu), mesh=mesh, strategy="optim")
        for step in range(2):
            state, _ = fs.train_step(state, batch(step), loss_fn)
        return state

    def moments(state) -> dict:
        by = state.opt_state_by_name()
        return {"mu": dict(by.mu), "nu": dict(by.nu)}

    def restored(directory, mu, nu):
        like = fs.init(model, _adamw(mu, nu), mesh=mesh, strategy="optim_grads_params")
        sizes = _buffer_sizes(like)
        state = fs.restore(directory, like=like)
        assert _buffer_sizes(state) == sizes, "restore allocates what init does (8-bit scales)"
        return state

    def decoded(state) -> dict:
        """fp32 values of a state's moments (8-bit ones dequantized)."""
        by, out = state.opt_state_by_name(), {}
        for field, dtype in (("mu", I8), ("nu", U8)):
            scales = getattr(by, field + "_scale") or {}
            out[field] = {}
            for name, t in getattr(by, field).items():
                if name in scales and t.dtype == dtype:
                    s = scales[name]
                    wide = torch.empty(t.numel())
                    MomentFormat(dtype, block_of(tuple(t.shape))).decode(
                        t.reshape(-1), s.reshape(-1), wide
                    )
                    out[field][name] = wide.view(t.shape)
                else:
                    out[field][name] = t.float()
        return out

    fp32 = trained(None, None)
    want = moments(fp32)
    fs.save(f"{tmp}/fp32", fp32)
    for mu, nu, rtol in [(BF16, BF16, 1e-2), (I8, U8, 5e-2)]:
        got = decoded(restored(f"{tmp}/fp32", mu, nu))
        for field in ("mu", "nu"):
            for name, t in want[field].items():
                bound = rtol * t.abs().amax().item() + 1e-12
                err = (got[field][name] - t).abs().max().item()
                assert err <= bound, (mu, field, name, err, bound)
    for mu, nu in [(BF16, BF16), (I8, U8)]:
        narrow = trained(mu, nu)
        want = decoded(narrow)
        fs.save(f"{tmp}/{mu}", narrow)
        same = restored(f"{tmp}/{mu}", mu, nu)  # as stored: bitwise
        a, b = same.opt_state_by_name(), narrow.opt_state_by_name()
        for field in ("mu", "nu", "mu_scale", "nu_scale"):
            x, y = getattr(a, field) or {}, getattr(b, field) or {}
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), field
        back = moments(restored(f"{tmp}/{mu}", None, None))  # dequantized / cast to fp32
        for field in ("mu", "nu"):
            for name, t in want[field].items():
                assert back[field][name].dtype == torch.float32
                torch.testing.assert_close(back[field][name], t, rtol=0, atol=0)


def test_checkpoint_conversion(pool1, tmp_path) -> None:
    pool1.run(_ckpt_worker, str(tmp_path))


def _saved_8bit_worker(directory: str) -> dict:
    """Trains and saves 8-bit moments on one rank; returns them by name (full tensors)."""
    model = make_model(5)
    state = fs.init(model, _adamw(I8, U8), mesh=fs.make_mesh(device_type="cpu"), strategy="optim")
    for step in range(2):
        state, _ = fs.train_step(state, batch(step), loss_fn_of(model))
    fs.save(directory, state)
    by = state.opt_state_by_name()
    return {f: {n: t.clone() for n, t in getattr(by, f).items()} for f in by._fields[1:]}


def _restored_8bit_worker(directory: str, strategy: str) -> dict:
    """This rank's rows of the moments restored onto ``strategy`` over the pool's ranks."""
    model = make_model(0)
    like = fs.init(model, _adamw(I8, U8), mesh=fs.make_mesh(device_type="cpu"), strategy=strategy)
    by = fs.restore(directory, like=like).opt_state_by_name()
    rows = {s.name: s.row_range(like.layout.shard_rank) for s in like.layout.leaves}
    return {"rows": rows, **{f: dict(getattr(by, f)) for f in by._fields[1:]}}


def test_8bit_moments_restore_across_layouts(pool1, pool3, tmp_path) -> None:
    """Saved on one rank, restored onto 3 (37 rows: 13, 13, 11; the ragged rows of 300 and the
    rows of 129 among them): every rank's rows of values and scales as saved, bit for bit."""
    saved = pool1.run(_saved_8bit_worker, str(tmp_path / "ckpt"))[0]
    assert saved["nu_scale"]["rag.weight"].shape == (37, 2)
    for got in pool3.run(_restored_8bit_worker, str(tmp_path / "ckpt"), "optim_grads_params"):
        for field, by_name in saved.items():
            for name, want in by_name.items():
                start, stop = got["rows"][name]
                mine = got[field][name]
                if mine.dim() == 0 or want.dim() == 0:
                    assert torch.equal(mine, want), (field, name)
                    continue
                assert torch.equal(mine, want[start:stop]), (field, name)


ORBAX_READ = """
import sys, numpy as np, orbax.checkpoint as ocp
tree = ocp.PyTreeCheckpointer().restore(sys.argv[1])["opt_state"]
np.savez(sys.argv[2], **{f + "/" + n: np.asarray(a) for f in ("mu", "mu_scale", "nu", "nu_scale")
                         for n, a in tree[f].items()})
"""


def _save_8bit_worker(directory: str) -> dict:
    model = make_model(5)
    state = fs.init(model, _adamw(I8, U8), mesh=fs.make_mesh(device_type="cpu"), strategy="optim")
    state, _ = fs.train_step(state, batch(0), loss_fn_of(model))
    fs.save(directory, state)
    by = state.opt_state_by_name()
    return {f: {n: t.clone() for n, t in getattr(by, f).items()} for f in ("mu", "mu_scale")}


def test_plain_orbax_reads_8bit_moments(pool1, tmp_path) -> None:
    """A JAX process sees plain int8 / uint8 arrays and their fp32 (rows, row/block) scales."""
    import os
    import subprocess
    import sys

    import numpy as np

    saved = pool1.run(_save_8bit_worker, str(tmp_path / "ckpt"))[0]
    out = str(tmp_path / "out.npz")
    proc = subprocess.run(
        [sys.executable, "-c", ORBAX_READ, str(tmp_path / "ckpt"), out],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    assert got["mu/up.weight"].dtype == np.int8 and got["nu/up.weight"].dtype == np.uint8
    assert got["mu_scale/up.weight"].shape == (75, 1) and got["mu/head.weight"].dtype == np.float32
    for field in ("mu", "mu_scale"):
        for name, t in saved[field].items():
            np.testing.assert_array_equal(got[f"{field}/{name}"], t.numpy(), err_msg=name)


def _blocked_worker(leaf: str) -> None:
    from funcshard.step import update as offload_lib

    model = make_model(7)
    opt = _adamw(I8, U8)
    results = []
    for block in (256, 1 << 20):  # blocks of the one-pass offloaded step cut the scales too
        state = fs.init(
            model,
            opt,
            mesh=fs.make_mesh(device_type="cpu"),
            policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
            strategy="no_shard",
            offload_fraction=1.0,
        )
        i = next(
            b.index for b in state.layout.buckets if leaf in state.layout.members[b.index].names
        )
        split = StateParts.of(state.opt_state)
        master = state.master[i].clone()
        grad = torch.randn(master.numel(), generator=torch.Generator().manual_seed(0))
        out = torch.empty(master.numel(), dtype=torch.bfloat16)
        new = offload_lib.step_and_cast(
            opt,
            split.select([i]),
            master,
            grad,
            out,
            block=block,
            members=state.layout.members[i],
        )
        results.append((master, out, new.mu[0], new.mu_scale[0], new.nu[0], new.nu_scale[0]))
    assert results[0][3].numel() > 1 and results[0][2].dtype == I8
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("leaf", ["up.weight", "rag.weight"])  # rag: ragged rows of 300
def test_blocked_offload_step_cuts_scales(pool1, leaf: str) -> None:
    pool1.run(_blocked_worker, leaf)

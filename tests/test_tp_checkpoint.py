"""Checkpoints of a tensor-parallel state hold GLOBAL arrays: saved at one (shard, tensor)
layout and restored at another (or onto the plain model), read by JAX's Orbax as full arrays,
exported as full Hugging Face tensors, and loaded model-only into a tensor-parallel model.

The model is ``helpers_tp``'s Llama (colwise q/k/v/w1/w3/head: Shard(0); rowwise o/w2:
Shard(1)) on 4 ranks, trained with SGD; Adam's 8-bit and bf16 moments on ``helpers_tp.Wide``
(colwise, rowwise whose local row the 8-bit block does not divide, and rowwise split unevenly).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import funcshard as fs
from funcshard.checkpoint import cli

import helpers_tp as H

LR, MOMENTUM, ROWS = 0.1, 0.9, 8


def _opt():
    return fs.optim.sgd(LR, momentum=MOMENTUM)


def _state(shard: int, tensor: int, seed: int = 3, model=None):
    mesh = H.world_mesh(shard, 1, tensor)
    model = H.make_model(seed) if model is None else model
    if tensor > 1:
        H.parallelize(model, mesh)
    return fs.init(model, _opt(), mesh=mesh, strategy="optim_grads_params"), model, mesh


def _cpu(full: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in full.items()}


def layouts_worker(root: str) -> dict:
    """Two steps at (S=2, T=2), then one step on each of (S=4, T=1), (S=1, T=4) and
    (S=2, T=2) again, each after restoring the previous layout's checkpoint."""
    state, model, mesh = _state(2, 2)
    state, _ = H.train(state, model, mesh, range(2), rows=ROWS)
    fs.save(os.path.join(root, "a"), state)
    out = {"saved": [_cpu(fs.full_params(state))], "restored": []}
    for i, (s, t) in enumerate([(4, 1), (1, 4), (2, 2)]):
        like, model, mesh = _state(s, t, seed=9)  # other values: all must come from the file
        state = fs.restore(os.path.join(root, "abc"[i]), like=like)
        out["restored"].append(_cpu(fs.full_params(state)))
        state, _ = H.train(state, model, mesh, [2 + i], rows=ROWS)
        fs.save(os.path.join(root, "abcd"[i + 1]), state)
        out["saved"].append(_cpu(fs.full_params(state)))
    return out


def _reference(steps: int) -> tuple[dict, dict]:
    """The plain model in one process: params and torch's momentum buffers."""
    model = H.make_model(3)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        batch = H.global_batch(step, ROWS)
        logits = model(batch["x"])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, H.VOCAB), batch["y"].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moms = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    return params, moms


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    # fp32 steps whose sums run in another order (tensor-parallel matmuls, the mean over
    # ranks): a few roundings of the largest values, relative to the tensor's norm
    err = float((got - want).norm() / want.norm())
    assert err < 1e-5, f"{name}: relative error {err}"


def test_round_trips_across_layouts_are_bitwise_and_train_as_one_run(pool4, tmp_path):
    out = pool4.run(layouts_worker, str(tmp_path))
    for r in out[1:]:  # every rank holds the full params
        for a, b in zip(r["saved"], out[0]["saved"], strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a)
    saved, restored = out[0]["saved"], out[0]["restored"]
    for i, full in enumerate(restored):  # each restore gives back exactly what was saved
        for name, t in full.items():
            assert torch.equal(t, saved[i][name]), f"layout {i}: {name}"
    ref, _ = _reference(5)
    for name, t in saved[-1].items():  # momentum restored each time: one uninterrupted run
        _close(t, ref[name], name)


JAX_RESTORE = textwrap.dedent("""
    import sys, numpy as np, orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore(sys.argv[1])
    flat = {"step": np.asarray(tree["step"])}
    for name, a in tree["params"].items():
        flat["params/" + name] = np.asarray(a)
    for name, a in tree["opt_state"]["momentum"].items():
        flat["momentum/" + name] = np.asarray(a)
    np.savez(sys.argv[2], **flat)
""")


def save_worker(directory: str, export: str, shard: int, tensor: int) -> dict:
    state, model, mesh = _state(shard, tensor)
    state, _ = H.train(state, model, mesh, range(2), rows=ROWS)
    fs.save(directory, state)
    fs.export_safetensors(export, state)
    return _cpu(fs.full_params(state))


def test_jax_orbax_and_safetensors_read_full_arrays(pool4, tmp_path):
    directory, export = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    full = pool4.run(save_worker, directory, export, 2, 2)[0]
    out = str(tmp_path / "out.npz")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", JAX_RESTORE, directory, out],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(out)
    assert int(got["step"]) == 2
    with open(os.path.join(directory, "params.layers.0.attn.o.weight", ".zarray")) as f:
        zarray = json.load(f)  # rowwise: a chunk column per tensor rank, a chunk row per shard
    assert zarray["shape"] == [H.DIM, H.DIM] and zarray["chunks"] == [H.DIM // 2, H.DIM // 2]
    _, moms = _reference(2)
    for name, t in full.items():
        np.testing.assert_array_equal(got["params/" + name], t.numpy(), err_msg=name)
        _close(torch.from_numpy(got["momentum/" + name]), moms[name], "momentum " + name)
    exported = load_file(os.path.join(export, "model.safetensors"))
    assert exported.keys() == full.keys()
    for name, t in full.items():
        assert torch.equal(exported[name], t), name
    assert cli.main(["verify", directory]) == 0
    assert cli.main(["inspect", directory]) == 0
    converted = str(tmp_path / "converted")
    assert cli.main(["convert", directory, converted, "--to", "safetensors"]) == 0
    again = load_file(os.path.join(converted, "model.safetensors"))
    assert all(torch.equal(again[n], t) for n, t in full.items())


def model_only_worker(root: str) -> dict:
    """A plain model's safetensors and DCP checkpoint loaded into tensor-parallel states."""
    import torch.distributed.checkpoint as dcp

    plain = H.make_model(5)
    sd = {n: p.detach().clone() for n, p in plain.named_parameters()}
    hf, dcp_dir = os.path.join(root, "plain.safetensors"), os.path.join(root, "dcp")
    if torch.distributed.get_rank() == 0:
        save_file(sd, hf)
    dcp.save(sd, checkpoint_id=dcp_dir)
    out = {}
    for label, path, (s, t) in [("hf", hf, (1, 4)), ("dcp", dcp_dir, (2, 2))]:
        like, _, _ = _state(s, t, seed=9)
        state = fs.restore(path, like=like, model_only=True)
        out[label] = all(torch.equal(v, sd[n]) for n, v in fs.full_params(state).items())
    return out


# --- Adam with 8-bit and narrow moments on colwise, rowwise and uneven rowwise weights -------

BETAS = (0.9, 0.999)
# One requantization of a value x in a block of absmax A (a block lies inside its row: A <= the
# row's absmax): int8 stores sqrt(x / A) to 0.5/127, so x moves by at most
# A (1/127 + 1/(4 127^2)); uint8 stores (x / A)^(1/4) to 0.5/255: at most A 4 (1 + 0.5/255)^3
# 0.5/255. The 1e-5 relative slack covers the codec's fp32 roundings (a few ulps).
BOUNDS = {"mu": 1 / 127 + 1 / (4 * 127**2), "nu": 4 * (1 + 0.5 / 255) ** 3 * 0.5 / 255}
# helpers_tp.Wide's 8-bit weights whose blocks follow the tensor degree (a rowwise weight's
# blocks cut its local row); the colwise and replicated ones are cut the same at every degree
REBLOCKED = {"down.weight", "odd.weight"}


def _adam(mu, nu):
    return fs.optim.adamw(1e-3, BETAS, mu_dtype=mu, nu_dtype=nu)


def _wide(shard: int, tensor: int, opt, seed: int = 3, strategy: str = "optim_grads_params"):
    mesh = H.world_mesh(shard, 1, tensor)
    model = H.make_wide(seed)
    if tensor > 1:
        H.parallelize_wide(model, mesh)
    return fs.init(model, opt, mesh=mesh, strategy=strategy), model, mesh


def _global_moments(directory: str) -> dict:
    """A checkpoint's moments as full fp32 tensors: restored onto fp32 Adam, every rank holding
    every row (no_shard, T=1), 8-bit ones dequantized with the blocks they were saved with."""
    like, _, _ = _wide(4, 1, _adam(None, None), seed=9, strategy="no_shard")
    by = fs.restore(directory, like=like).opt_state_by_name()
    return {
        (f, n): t.detach().cpu().clone() for f in ("mu", "nu") for n, t in getattr(by, f).items()
    }


def moments_worker(root: str, mu, nu) -> dict:
    """Two steps at (S=2, T=2), saved; restored at (S=4, T=1), (S=1, T=4) and (S=2, T=2), saved
    again there and stepped once more; every checkpoint's moments as full fp32 tensors."""
    state, model, mesh = _wide(2, 2, _adam(mu, nu))
    state, _ = H.train(state, model, mesh, range(2), rows=ROWS)
    fs.save(os.path.join(root, "a"), state)
    fs.export_safetensors(os.path.join(root, "hf"), state)  # an uneven rowwise block too
    out = {"saved": _cpu(fs.full_params(state)), "restored": [], "losses": []}
    for s, t in [(4, 1), (1, 4), (2, 2)]:
        like, model, mesh = _wide(s, t, _adam(mu, nu), seed=9)
        state = fs.restore(os.path.join(root, "a"), like=like)
        out["restored"].append(_cpu(fs.full_params(state)))
        fs.save(os.path.join(root, f"t{t}"), state)
        state, history = H.train(state, model, mesh, [2], rows=ROWS)
        out["losses"].append(float(history[0]["loss"]))
    out["moments"] = {d: _global_moments(os.path.join(root, d)) for d in ("a", "t1", "t4", "t2")}
    return out


@pytest.mark.parametrize(
    "mu,nu", [(torch.int8, torch.uint8), (torch.bfloat16, torch.bfloat16)], ids=["8bit", "bf16"]
)
def test_adam_narrow_moments_restore_across_tensor_degrees(pool4, tmp_path, mu, nu):
    """Adam's narrow moments of colwise, rowwise and unevenly split rowwise weights, saved at
    T=2 and restored at T=1, T=4 and T=2: params bitwise; moments bitwise where the blocks
    are the same (all bf16, colwise and replicated 8-bit), else within one requantization
    (a rowwise weight's 8-bit blocks cut its local row, which the tensor degree sets)."""
    out = pool4.run(moments_worker, str(tmp_path), mu, nu)
    first = out[0]
    for r in out:
        for full in r["restored"]:
            assert all(torch.equal(full[n], t) for n, t in first["saved"].items())
        assert all(np.isfinite(loss) for loss in r["losses"])
    exported = load_file(os.path.join(tmp_path, "hf", "model.safetensors"))
    assert all(torch.equal(exported[n], t) for n, t in first["saved"].items())
    saved = first["moments"]["a"]
    assert {n for _, n in saved} == {n for n, _ in H.make_wide().named_parameters()}
    for label in ("t1", "t4", "t2"):
        for (field, name), want in saved.items():
            got = first["moments"][label][(field, name)]
            if label == "t2" or name not in REBLOCKED or mu == torch.bfloat16:
                assert torch.equal(got, want), f"{label}: {field} {name}"
                continue
            rowmax = want.abs().amax(dim=1, keepdim=True)
            excess = float(((got - want).abs() - rowmax * BOUNDS[field] * (1 + 1e-5)).amax())
            assert excess <= 0, f"{label}: {field} {name} over its bound by {excess}"


def test_model_only_loads_into_a_tensor_parallel_model(pool4, tmp_path):
    for r in pool4.run(model_only_worker, str(tmp_path)):
        assert r == {"hf": True, "dcp": True}


def mismatch_worker(directory: str) -> str:
    state, _, _ = _state(2, 2)
    fs.save(directory, state)
    model = H.make_model(3)
    model.layers[0].mlp.w1 = torch.nn.Linear(H.DIM, 48)  # 48 colwise rows: 24 a tensor rank
    like, _, _ = _state(2, 2, model=copy.deepcopy(model))
    with pytest.raises(fs.checkpoint.CheckpointMismatchError) as e:
        fs.restore(directory, like=like)
    return str(e.value)


def test_mismatch_names_the_leaf_in_global_shapes(pool4, tmp_path):
    message = pool4.run(mismatch_worker, str(tmp_path / "ckpt"))[0]
    assert "params.layers.0.mlp.w1.weight: shape (44, 20) in the checkpoint, expected (48, 20)" in (
        message
    ), message

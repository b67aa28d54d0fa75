"""Damaged checkpoints: a truncated or deleted chunk, garbled metadata, another dtype or another
model raise on every rank naming the leaf (or the file); restore consumes ``like``.

Every case damages a copy of one small checkpoint saved on 2 ranks (the module's ``saved``).
Checksummed bit flips are ``test_checksums.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import funcshard as fs

import models
from helpers_errors import cpu_params, error_text

LEAF = "params.blocks.0.fc.weight"  # 37 rows: rank 1 owns chunk "1.0"


def save_small(directory: str) -> None:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    fs.save(directory, state)


def restore_probe(directory: str) -> str | None:
    """The error restoring ``directory`` raises on this rank, or None."""
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    return error_text(lambda: fs.full_params(fs.restore(directory, like=like)))


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("reliability") / "ckpt")
    pool2.run(save_small, directory)
    return directory


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _set_dtype(zarray: str, dtype: str) -> None:
    with open(zarray) as f:
        meta = json.load(f)
    meta["dtype"] = dtype
    with open(zarray, "w") as f:
        json.dump(meta, f)


def _garble(path: str) -> None:
    with open(path, "w") as f:
        f.write('{"tree_metadata": {')


CORRUPTIONS = {  # name -> (damage, text every failing rank's error must hold)
    "truncated_chunk_of_rank_1": (lambda d: _truncate(os.path.join(d, LEAF, "1.0")), LEAF),
    "truncated_chunk_of_rank_0": (
        lambda d: _truncate(os.path.join(d, "opt_state.nu.inp.weight", "0.0")),
        "opt_state.nu.inp.weight",
    ),
    "garbled_zarray": (
        lambda d: _garble(os.path.join(d, "params.head.bias", ".zarray")),
        "params.head.bias",
    ),
    "deleted_leaf_directory": (
        lambda d: shutil.rmtree(os.path.join(d, "opt_state.mu.head.weight")),
        "opt_state.mu.head.weight",
    ),
    "integer_dtype": (
        lambda d: _set_dtype(os.path.join(d, "params.head.weight", ".zarray"), "<i4"),
        "params.head.weight",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_raises_on_every_rank_naming_the_leaf(pool2, saved, tmp_path, case):
    damage, needle = CORRUPTIONS[case]
    directory = str(tmp_path / "ckpt")
    shutil.copytree(saved, directory)
    damage(directory)
    errors = pool2.run(restore_probe, directory)
    assert all(e is not None for e in errors), f"{case}: silent success: {errors}"
    assert any(needle in e for e in errors), f"{case}: no rank names {needle}: {errors}"
    for e in errors:
        assert needle in e or "failed on rank(s)" in e, e


@pytest.mark.parametrize(
    "chunk",
    [
        f"{LEAF}/1.0",  # only rank 1 reads it
        "params.scale/0",  # a 0-d parameter
        "opt_state.count/0",
        "step/0",
    ],
)
def test_deleted_chunk_file_raises(pool2, saved, tmp_path, chunk):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(saved, directory)
    os.remove(os.path.join(directory, chunk))
    errors = pool2.run(restore_probe, directory)
    assert all(e is not None for e in errors), f"silent success: {errors}"
    leaf = chunk.split("/")[0]
    assert any(leaf in e for e in errors), errors
    for e in errors:
        assert leaf in e or "failed on rank(s)" in e, e


def test_garbled_metadata_names_the_file(pool2, saved, tmp_path):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(saved, directory)
    _garble(os.path.join(directory, "_METADATA"))
    errors = pool2.run(restore_probe, directory)
    assert all(e is not None and "_METADATA" in e for e in errors), errors


def other_model_probe(directory: str) -> str | None:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0, dim=36, n_blocks=2)  # other shapes, fewer names
    like = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    return error_text(lambda: fs.restore(directory, like=like))


def test_checkpoint_of_another_model_lists_the_mismatches(pool2, saved):
    for e in pool2.run(other_model_probe, saved):
        assert e is not None and "CheckpointMismatchError" in e
        assert "params.inp.weight: shape (37, 5) in the checkpoint, expected (36, 5)" in e
        assert "params.blocks.2.fc.weight: in the checkpoint but not in the target" in e


# --- consumed by restore (it shares the saved checkpoint) ---------------------------------------


def consumed_by_restore(directory: str) -> list[str | None]:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=1)
    like = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    state = fs.restore(directory, like=like)
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    errors = [
        error_text(use)
        for use in (
            lambda: like.params,
            lambda: fs.full_params(like),
            lambda: fs.save(directory + "-x", like),
            lambda: fs.restore(directory, like=like),
            lambda: fs.train_step(like, batch, models.make_loss_fn(model)),
        )
    ]
    fs.train_step(state, batch, models.make_loss_fn(model))  # the restored state works
    return errors


def test_restore_consumes_like(pool2, saved):
    for errors in pool2.run(consumed_by_restore, saved):
        for e in errors:
            assert e is not None and "ConsumedStateError" in e and "consumed by restore" in e, e
    assert not os.path.exists(saved + "-x")


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _set_shape(zarray: str, shape: list[int]) -> None:
    with open(zarray) as f:
        meta = json.load(f)
    meta["shape"] = shape
    with open(zarray, "w") as f:
        json.dump(meta, f)


FALLBACK_DAMAGE = {  # step -> (damage to its item, what the error names); rank 1 alone reads 1.0
    2: (lambda item: _flip_byte(os.path.join(item, LEAF, "1.0"), 5), "ChecksumError"),
    3: (lambda item: os.remove(os.path.join(item, LEAF, "1.0")), f"chunk 1 of {LEAF} is missing"),
    4: (lambda item: _set_shape(os.path.join(item, LEAF, ".zarray"), [37, 6]), f"{LEAF}/.zarray"),
}


def fallback_worker(root: str) -> dict:
    """Saves steps 1-4, damages 2-4, restores each with ONE ``like``, then falls back to 1."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=0)
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    batch = models.local_batch(models.global_batch(0, 8), dist.get_rank(), 2)
    mgr = fs.CheckpointManager(root, max_to_keep=None, async_save=False)
    mgr.save(1, state)
    at1 = cpu_params(fs.full_params(state))
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    for step, (damage, _) in FALLBACK_DAMAGE.items():
        mgr.save(step, state)
        if dist.get_rank() == 0:
            damage(os.path.join(root, str(step), "default"))
    dist.barrier()
    like = fs.init(models.make_model(seed=1), fs.optim.adamw(1e-2), mesh=mesh, strategy="optim")
    before = cpu_params(like.params)
    failures = {}
    for step in FALLBACK_DAMAGE:
        error = error_text(lambda step=step: mgr.restore(step, like=like))
        failures[step] = {
            "error": error,
            "consumed": like.consumed,
            "unchanged": all(torch.equal(t, before[n]) for n, t in like.params.items()),
        }
    restored = mgr.restore(1, like=like)
    return {
        "failures": failures,
        "exact": all(torch.equal(t, at1[n]) for n, t in fs.full_params(restored).items()),
        "consumed_after_success": like.consumed,
    }


def test_failed_restore_leaves_like_usable_for_an_older_step(pool2, tmp_path):
    """A restore that fails on one rank only (a flipped byte, a missing chunk, a changed
    shape) consumes ``like`` on no rank and leaves its values as they were; the same ``like``
    then restores the previous step exactly."""
    for rank, r in enumerate(pool2.run(fallback_worker, str(tmp_path / "run"))):
        for step, f in r["failures"].items():
            needle = FALLBACK_DAMAGE[step][1]
            assert f["error"] is not None, f"rank {rank}, step {step}: silent success"
            assert needle in f["error"] or "failed on rank(s) [1]" in f["error"], f["error"]
            assert not f["consumed"], f"rank {rank}, step {step}: like consumed: {f['error']}"
            assert f["unchanged"], f"rank {rank}, step {step}: like's values were overwritten"
        assert r["exact"] and r["consumed_after_success"], r

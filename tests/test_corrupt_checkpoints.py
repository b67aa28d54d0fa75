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
import torch.distributed as dist

import funcshard as fs

import models
from helpers_errors import error_text

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

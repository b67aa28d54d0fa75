"""Checksums: every bit flipped in a chunk file is caught by restore, on every rank, and so
is every edit of the metadata that says how the bytes are read.

One AdamW checkpoint (params, moments, scalars) saved at 2 ranks, by ``fs.save`` and by an
asynchronous ``CheckpointManager``; single bits flipped at random offsets of the data bytes
of every kind of leaf; restored at 2 ranks (the same layout) and at 3 (resharding: reads cut
through chunks). Then the metadata tampered with (``helpers_checksums.TAMPERING``, which
test_cli's ``verify`` checks too), and the records of older formats, which still restore.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import warnings

import pytest
import torch.distributed as dist

import funcshard as fs
from funcshard import checkpoint as ckpt_lib
from funcshard.checkpoint.api import open_source

import helpers_checksums
import models

ROWS = 12
UNVERIFIED = ckpt_lib.UnverifiedCheckpointWarning
ITEMSIZE = {"<f4": 4, "<f8": 8, "<i8": 8, "bfloat16": 2, "<f2": 2}


def _state(seed: int, strategy: str) -> fs.TrainState:
    mesh = fs.make_mesh(device_type="cpu")
    return fs.init(models.make_model(seed=seed), fs.optim.adamw(1e-2), mesh=mesh, strategy=strategy)


def save_worker(directory: str, root: str) -> dict:
    model = models.make_model(seed=0)
    state = _state(0, "optim_grads_params")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, ROWS), rank, world)
    state, _ = fs.train_step(state, batch, models.make_loss_fn(model))
    fs.save(directory, state)
    with fs.CheckpointManager(root) as mgr:  # asynchronous
        mgr.save(1, state)
    return {n: t.detach().cpu().clone() for n, t in fs.full_params(state).items()}


def _flip(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def flips_worker(directory: str, flips: list, strategy: str) -> list[dict]:
    """Restores once per flip (rank 0 flips the bit before and back after)."""
    out = []
    for path, offset, bit in flips:
        if dist.get_rank() == 0:
            _flip(path, offset, bit)
        dist.barrier()
        like = _state(1, strategy)
        try:
            if directory.endswith("manager"):
                fs.CheckpointManager(directory).restore(1, like=like)
            else:
                fs.restore(directory, like=like)
            out.append({"type": None})
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append({"type": type(e).__name__, "message": str(e)})
        dist.barrier()
        if dist.get_rank() == 0:
            _flip(path, offset, bit)
        dist.barrier()
    return out


def restore_worker(directory: str) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = fs.restore(directory, like=_state(1, "optim"))
    return {
        "full": {n: t.detach().cpu().clone() for n, t in fs.full_params(state).items()},
        "warned": [
            str(w.message) for w in caught if w.category is ckpt_lib.UnverifiedCheckpointWarning
        ],
    }


def restore_error_worker(directory: str) -> str | None:
    try:
        fs.restore(directory, like=_state(1, "optim"))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    root = tmp_path_factory.mktemp("checksums")
    directory, manager = str(root / "ckpt"), str(root / "manager")
    full = pool2.run(save_worker, directory, manager)[0]
    return directory, manager, full


def _data_bytes(item: str) -> dict[str, list[tuple[str, int]]]:
    """leaf -> [(chunk file, its data bytes)] of every leaf of an item (padding left out)."""
    out = {}
    for leaf in sorted(os.listdir(item)):
        zarray = os.path.join(item, leaf, ".zarray")
        if not os.path.exists(zarray):
            continue
        md = json.load(open(zarray))
        shape, chunks = md["shape"], md["chunks"]
        row = math.prod(shape[1:]) * ITEMSIZE[md["dtype"]]
        if not shape:
            out[leaf] = [(os.path.join(item, leaf, "0"), ITEMSIZE[md["dtype"]])]
            continue
        files = []
        for k in range(-(-shape[0] // chunks[0])):
            name = ".".join([str(k)] + ["0"] * (len(shape) - 1))
            rows = min(shape[0], (k + 1) * chunks[0]) - k * chunks[0]
            files.append((os.path.join(item, leaf, name), rows * row))
        out[leaf] = files
    return out


def _random_flips(item: str, seed: int, per_kind: int) -> list[tuple[str, int, int]]:
    """Single bits at random offsets: ``per_kind`` in params, mu and nu, and every scalar."""
    rng = random.Random(seed)
    leaves = _data_bytes(item)
    kinds = {
        kind: [(f, n) for leaf, fs_ in leaves.items() if leaf.startswith(kind) for f, n in fs_]
        for kind in ("params.", "opt_state.mu.", "opt_state.nu.")
    }
    flips = []
    for chunks in kinds.values():
        assert chunks
        for _ in range(per_kind):
            path, n = rng.choice(chunks)
            flips.append((path, rng.randrange(n), rng.randrange(8)))
    for scalar in ("opt_state.count", "step"):
        path, n = leaves[scalar][0]
        flips.append((path, rng.randrange(n), rng.randrange(8)))
    return flips


def _check_caught(results: list[list[dict]], flips: list) -> None:
    for rank, per_rank in enumerate(results):
        for (path, offset, _), r in zip(flips, per_rank, strict=True):
            what = f"rank {rank}, flip at {path}:{offset}"
            assert r["type"] == "ChecksumError", f"{what}: {r}"
            leaf = os.path.basename(os.path.dirname(path))
            assert leaf in r["message"] and path in r["message"], f"{what}: {r['message']}"
            ranges = re.findall(
                re.escape(path) + r", bytes (\d+):(\d+)", r["message"]
            )  # every rank quotes the detecting rank's range
            assert any(int(a) <= offset < int(b) for a, b in ranges), f"{what}: {r['message']}"


@pytest.mark.parametrize("world", [2, 3], ids=["same-layout", "reshard-2to3"])
def test_every_flipped_bit_is_caught_on_every_rank(request, saved, world):
    directory, _, _ = saved
    flips = _random_flips(directory, seed=world, per_kind=4)
    strategy = "optim_grads_params" if world == 2 else "optim"
    results = request.getfixturevalue(f"pool{world}").run(flips_worker, directory, flips, strategy)
    _check_caught(results, flips)
    assert len(flips) == 14


def test_async_manager_checkpoints_are_verified(pool3, saved):
    _, manager, _ = saved
    flips = _random_flips(os.path.join(manager, "1", "default"), seed=7, per_kind=1)
    results = pool3.run(flips_worker, manager, flips, "optim")
    _check_caught(results, flips)


# --- damaged metadata: what says how the bytes are read is checked too -------------------------


def test_clean_restore_is_exact_and_older_formats_restore(pool2, saved, tmp_path):
    directory, _, full = saved
    for r in pool2.run(restore_worker, directory):
        assert r["warned"] == []
        assert models.max_rel_err(r["full"], full) == 0
    v2 = str(tmp_path / "v2")  # chunk checksums only: verified, no warning
    shutil.copytree(directory, v2)
    helpers_checksums.as_format(v2, 2)
    for r in pool2.run(restore_worker, v2):
        assert r["warned"] == []
        assert models.max_rel_err(r["full"], full) == 0
    v1 = str(tmp_path / "v1")  # saved before checksums existed
    shutil.copytree(directory, v1)
    helpers_checksums.as_format(v1, 1)
    for r in pool2.run(restore_worker, v1):
        assert len(r["warned"]) == 1 and "cannot be verified" in r["warned"][0]
        assert models.max_rel_err(r["full"], full) == 0


def test_lost_checksums_of_a_checksummed_checkpoint_raise(pool2, saved, tmp_path):
    directory, _, _ = saved
    old = str(tmp_path / "old")
    shutil.copytree(directory, old)
    os.remove(os.path.join(old, "_CHECKSUMS"))  # lost: damage, on every rank
    errors = pool2.run(restore_error_worker, old)
    assert all("_CHECKSUMS is missing" in e for e in errors), errors


@pytest.mark.parametrize("case", list(helpers_checksums.TAMPERING))
def test_damaged_metadata_raises_naming_the_file(pool2, saved, tmp_path, case):
    """Each edit would restore unverified or wrong values without the metadata's own
    checksums and funcshard's marks; every rank raises, naming the damaged file."""
    directory, _, _ = saved
    item = str(tmp_path / "ckpt")
    shutil.copytree(directory, item)
    path = helpers_checksums.TAMPERING[case](item)
    for e in pool2.run(restore_error_worker, item):
        assert e is not None, f"{case}: restored silently"
        assert path in e and "damaged" in e, f"{case}: {e}"


def test_each_mark_alone_keeps_verification_on(saved, tmp_path):
    """With ``_CHECKSUMS`` gone, any one of funcshard's three marks makes the checkpoint
    refused: the record, ``_METADATA``'s custom_metadata, the commit file."""
    directory, _, _ = saved
    marks = {
        "_CHECKPOINT_METADATA": lambda item: helpers_checksums.edit_json(
            os.path.join(item, "_CHECKPOINT_METADATA"),
            lambda r: r["custom_metadata"]["funcshard"].update(checksums="crc32c"),
        ),
        "_METADATA": lambda item: helpers_checksums.edit_json(
            os.path.join(item, "_METADATA"),
            lambda m: m.update(custom_metadata={"funcshard": {"version": 3}}),
        ),
        "commit_success.txt": lambda item: open(
            os.path.join(item, "commit_success.txt"), "a"
        ).write("\nfuncshard format 3, checksums crc32c\n"),
    }
    for name, mark in marks.items():
        item = str(tmp_path / name)
        shutil.copytree(directory, item)
        helpers_checksums.as_format(item, 1)
        assert open_source(item).checksums is None  # unmarked: read as saved before them
        mark(item)
        with pytest.raises(FileNotFoundError, match=re.escape(os.path.join(item, name))):
            open_source(item)

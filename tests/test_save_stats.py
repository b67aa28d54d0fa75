"""What a checkpoint save costs its caller: ``mgr.last_save_stats()`` (the stall)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard.checkpoint import storage

import models


def stall_worker(root: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=7)
    state = fs.init(
        model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy="optim_grads_params"
    )
    out = {}
    for background in (True, False):
        with fs.CheckpointManager(os.path.join(root, str(background)), async_save=background) as m:
            m.save(0, state)
            staged = m.last_save_stats()
            m.wait()
            out[background] = (staged, m.last_save_stats())
    return out


def test_last_save_stats_say_what_the_caller_waited_for(pool2, tmp_path) -> None:
    for result in pool2.run(stall_worker, str(tmp_path)):
        (staged, written), (sync, _) = result[True], result[False]
        assert staged["written_s"] is None or staged["written_s"] > 0  # may have finished
        assert written["written_s"] > 0 and written["staged_s"] == staged["staged_s"]
        assert written["bytes"] == sync["bytes"] > 0  # this rank's rows, either way
        assert sync["staged_s"] == sync["written_s"]  # a synchronous save blocks throughout


def tier_stats_worker(root: str) -> list[dict]:
    """Steps 1-3 with a local tier (two ranks as two nodes), step 2 to root too."""
    mesh = fs.make_mesh(device_type="cpu")
    model = models.make_model(seed=7)
    state = fs.init(model, fs.optim.adamw(0.1), mesh=mesh, strategy="optim_grads_params")
    local = os.path.join(root, "local-{node}")
    kw = dict(local_dir=local, ranks_per_node=1, persistent_every=2)
    out = []
    with fs.CheckpointManager(os.path.join(root, "root"), **kw) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state)
            staged = mgr.last_save_stats()
            mgr.wait()
            out.append((staged, mgr.last_save_stats()))
    return out


def test_last_save_stats_with_a_local_tier_are_the_last_saves(pool2, tmp_path) -> None:
    """Each save's own figures: the tier's write counts in the stall, and a step kept in the
    tier only reports no persistent bytes (not the previous persistent save's)."""
    for result in pool2.run(tier_stats_worker, str(tmp_path)):
        for step, (staged, written) in zip((1, 2, 3), result, strict=True):
            assert staged["step"] == written["step"] == step, result
            assert written["persistent"] == (step == 2), result
            assert written["local_bytes"] > 0 and written["local_s"] > 0, result
            assert written["staged_s"] >= written["local_s"], result  # the tier's write stalls
            if step == 2:
                assert written["bytes"] > 0 and written["written_s"] > 0, result
            else:
                assert written["bytes"] == 0, result
                assert written["staged_s"] == written["written_s"] == written["local_s"], result


def _steps(state, model, steps, device: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_fn = models.make_loss_fn(model)
    for step in steps:
        batch = models.local_batch(models.global_batch(step, 8), rank, world)
        batch = {k: v.to(device) for k, v in batch.items()}
        state, _ = fs.train_step(state, batch, loss_fn)
    return state


def _tensorstore_nice() -> list[int]:
    """The nice values of tensorstore's worker threads (Linux)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ts_pool"):
                    out.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # it ended while we looked (ENOENT or ESRCH, by timing)
            continue
    return out


def staging_worker(root: str, device: str) -> dict:
    """Two background saves with training in between: the second reuses the first's host
    buffers (pinned for CUDA rows), and each step restores to the params it had when saved."""
    mesh = fs.make_mesh(device_type=device)
    model = models.make_model(seed=7).to(device)
    make = lambda: fs.init(model, fs.optim.adamw(0.01), mesh=mesh, strategy="optim_grads_params")
    state, saved, buffers = make(), {}, []
    with fs.CheckpointManager(root, max_to_keep=None) as mgr:
        for step in (1, 2):
            state = _steps(state, model, [step], device)
            saved[step] = {k: v.cpu() for k, v in fs.full_params(state).items()}
            mgr.save(step, state)  # returns once staged: the next step overwrites in place
            staged = mgr.saver._staging._buffers.values()
            buffers.append([(b.data_ptr(), b.is_pinned()) for b in staged])
            state = _steps(state, model, [10 + step], device)
        mgr.wait()
        held, stats = mgr.saver._staging.nbytes(), mgr.last_save_stats()
        restored = {s: fs.full_params(mgr.restore(s, like=make())) for s in (1, 2)}
    same = all(torch.equal(restored[s][k].cpu(), saved[s][k]) for s in (1, 2) for k in saved[s])
    return {
        "nice": _tensorstore_nice(),
        "reused": buffers[0] == buffers[1],
        "pinned": all(p for _, p in buffers[0]),
        "held": held,
        "bytes": stats["bytes"],
        "same": same,
    }


def test_background_saves_reuse_their_host_buffers(pool2, tmp_path) -> None:
    for r in pool2.run(staging_worker, str(tmp_path), "cpu"):
        assert r["same"]  # the staged copy, not the state trained on after save returned
        assert r["reused"] and r["held"] == r["bytes"] > 0  # one host copy of this rank's rows
        assert not r["pinned"]
        # the write yields to the step: tensorstore's workers (restore used them too) niced
        assert r["nice"] and min(r["nice"]) == storage.BACKGROUND_NICE, r["nice"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_are_staged_in_pinned_reused_buffers(tmp_path) -> None:
    [r] = fs.launch(staging_worker, str(tmp_path), "cuda", nproc=1)
    assert r["same"] and r["reused"] and r["pinned"] and r["held"] == r["bytes"] > 0

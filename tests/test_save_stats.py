"""What a checkpoint save costs its caller: ``mgr.last_save_stats()`` (the stall)."""

from __future__ import annotations

import os

import funcshard as fs

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

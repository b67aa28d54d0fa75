"""DCP in: ``fs.restore(dcp_dir, like=state, model_only=True)`` of checkpoints that
``torch.distributed.checkpoint`` wrote, from a plain model's state_dict (one process) and from
an FSDP2 model sharded over 2 ranks; each rank reads only the stored chunks its rows overlap.
(DCP out, ``convert --to=dcp``, is in test_cli.py.)
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import funcshard as fs

import models


def _seq(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 37), nn.Tanh(), nn.Linear(37, 37), nn.Tanh(), nn.Linear(37, 11)
    )


def fsdp2_save_worker(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _seq(seed=0)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    # torchtitan-like: the model nested under "model", beside state that is not the model's
    dcp.save(
        {"model": model.state_dict(), "train_state": {"step": torch.tensor(5)}}, checkpoint_id=path
    )


def restore_worker(path: str, seq: bool, strategy: str, offload: float) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = _seq(seed=1) if seq else models.make_model(seed=1)
    like = fs.init(
        model, fs.optim.adamw(1e-3), mesh=mesh, strategy=strategy, offload_fraction=offload
    )
    reads = []
    real = dcp.FileSystemReader.read_data

    def spy(self, plan, planner):  # which stored chunks this rank asks DCP for
        reads.extend((i.storage_index.fqn, tuple(i.storage_index.offset)) for i in plan.items)
        return real(self, plan, planner)

    dcp.FileSystemReader.read_data = spy
    try:
        state = fs.restore(path, like=like, model_only=True)
    finally:
        dcp.FileSystemReader.read_data = real
    rows = {s.name: s.row_range(state.layout.shard_rank) for s in state.layout.leaves}
    return {
        "full": {n: t.detach().cpu().clone() for n, t in fs.full_params(state).items()},
        "chunks": sorted(set(reads)),
        "rows": rows,
    }


def test_plain_state_dict_restores_onto_three_ranks(pool3, tmp_path):
    model = models.make_model(seed=0)
    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP says it saves in one process
        dcp.save(model.state_dict(), checkpoint_id=path)
    for r in pool3.run(restore_worker, path, False, "optim_grads_params", 0.5):
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["full"][name], p.detach(), rtol=0, atol=0, msg=name)


def test_fsdp2_checkpoint_each_rank_reads_its_chunks(pool2, pool3, tmp_path):
    path = str(tmp_path / "fsdp2")
    pool2.run(fsdp2_save_worker, path)
    model = _seq(seed=0)
    want = {n: p.detach() for n, p in model.named_parameters()}
    for world, pool in ((2, pool2), (3, pool3)):
        for rank, r in enumerate(pool.run(restore_worker, path, True, "optim_grads_params", 0.0)):
            for name, t in want.items():
                torch.testing.assert_close(r["full"][name], t, rtol=0, atol=0, msg=name)
            assert all(fqn.startswith("model.") for fqn, _ in r["chunks"])
            if world == 2:  # FSDP2's dim-0 shards are these ranks' rows: one chunk each
                assert len(r["chunks"]) == len(want), r["chunks"]
                for fqn, offset in r["chunks"]:
                    assert offset[0] == r["rows"][fqn.removeprefix("model.")][0], (rank, fqn)

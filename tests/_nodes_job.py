"""The job the multi-node test runs in every node under torchrun (see test_nodes.py).

    torchrun ... tests/_nodes_job.py --out=OUT --shard=2 --replicate=2 \
        [--strategy=optim_grads_params] [--outer_strategy=optim] [--steps=3]

Trains the small MLP of ``models.py`` with SGD momentum (fp32) on this rank's slice of
``models.global_batch``; rank 0 writes ``{"params", "losses", "world"}`` to OUT with
``torch.save``. ``--outer_strategy=optim`` makes it HFSDP.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import funcshard as fs  # noqa: E402

import models  # noqa: E402

LOCAL_ROWS = 6
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 0.01


def fs_optimizer() -> fs.optim.Optimizer:
    return fs.optim.sgd(LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def torch_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def run(
    out: str,
    steps: int,
    shard: int,
    replicate: int,
    strategy: str,
    outer_strategy: str,
) -> None:
    fs.init_from_env("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(shard=shard, replicate=replicate, device_type="cpu")
    model = models.make_model(seed=7)
    state = fs.init(
        model, fs_optimizer(), mesh=mesh, strategy=strategy, outer_strategy=outer_strategy
    )
    loss_fn = models.make_loss_fn(model)
    losses = []
    for step in range(steps):
        batch = models.local_batch(models.global_batch(step, LOCAL_ROWS * world), rank, world)
        state, metrics = fs.train_step(state, batch, loss_fn)
        losses.append(metrics["loss"])
    params = fs.full_params(state)
    if rank == 0:
        tmp = f"{out}.tmp"
        torch.save({"params": params, "losses": losses, "world": world}, tmp)
        os.replace(tmp, out)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shard", type=int, default=-1)
    p.add_argument("--replicate", type=int, default=1)
    p.add_argument("--strategy", default="optim_grads_params")
    p.add_argument("--outer_strategy", default="no_shard")
    a = p.parse_args(argv)
    run(a.out, a.steps, a.shard, a.replicate, a.strategy, a.outer_strategy)


if __name__ == "__main__":
    main()

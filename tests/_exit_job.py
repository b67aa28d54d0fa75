"""A job written like README's user loop, for the exit test of test_launch.py.

    torchrun --nproc-per-node=2 tests/_exit_job.py CKPT_DIR [--outer=no_shard|optim]

Everything lives in module globals and stays there to the end, as in the README: the mesh, the
state (its layout holds the mesh's groups), a ``CheckpointManager`` that has saved (its saver
holds the checkpoint's own group). The world is destroyed and the script ends: funcshard must
free every group it holds before the interpreter finalizes, or a gloo worker may be ended there
inside a C++ destructor ("terminate called without an active exception"), which torchrun counts
as a failed rank. A long switch interval makes that race frequent (the main thread keeps the
GIL for 0.5 s while the workers wait for it).
"""

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import funcshard as fs

# Under `if __name__ == "__main__"` so that pytest's doctest collection can import the file; the
# names below are module globals all the same, as in the README's loop.
if __name__ == "__main__":
    sys.setswitchinterval(0.5)  # after the imports: they need not be slow
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--outer", default="no_shard")
    a = p.parse_args()

    fs.init_from_env("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    world = dist.get_world_size()
    mesh = fs.make_mesh(replicate=2 if a.outer == "optim" else 1, device_type="cpu")
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(lr=1e-3, weight_decay=0.1)
    )
    state = fs.init(model, opt, mesh=mesh, strategy="optim_grads_params", outer_strategy=a.outer)
    mgr = fs.CheckpointManager(a.ckpt, max_to_keep=2)

    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        return torch.nn.functional.cross_entropy(logits, batch["y"])

    for step in range(4):
        g = torch.Generator().manual_seed(step * world + dist.get_rank())
        batch = {"x": torch.randn(8, 16, generator=g), "y": torch.randint(0, 4, (8,), generator=g)}
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=2)
        if step == 1:
            mgr.save(step + 1, state)
    mgr.wait()
    dist.destroy_process_group()

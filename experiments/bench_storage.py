"""Checkpoints at scale: an object store beside a local path, and the stall of a save.

On gloo CPU ranks, one AdamW ZeRO-3 state (masters + mu + nu, fp32) of ``--layers`` square
Linear layers ``--dim`` wide:

* ``s3``: save and same-layout restore through a local S3 server (moto's, started here;
  tensorstore's s3 kvstore, every rank writing its own rows straight to the store) beside
  the same on a local path, best of ``--reps``, ratios s3 / path;
* ``tier``: 4 ranks as 2 nodes of 2: the restore from the local tier after one node's tier
  is lost (its ranks receive their values from the replicas on the other node) beside the
  restore of the same step from the persistent checkpoint (on the S3 server, and on a path);
* ``stall``: what ``mgr.save`` blocks the loop for (``last_save_stats()["staged_s"]``, the
  rows copied to the saver's host buffers) beside a synchronous save's time; and the training
  step's time while a background write runs beside the step before it, without one (``--steps``
  rounds, each measure beside its peer of the same round).

    python experiments/bench_storage.py                      # both parts, 2 ranks
    python experiments/bench_storage.py --parts=stall --dim=2048 --layers=8
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from absl import app, flags
from torch import nn

import funcshard as fs
from funcshard.testing import local_s3

DIM = flags.DEFINE_integer("dim", 1536, "width of the square Linear layers")
LAYERS = flags.DEFINE_integer("layers", 8, "number of Linear layers")
REPS = flags.DEFINE_integer("reps", 3, "repetitions of a save / restore; the best is reported")
STEPS = flags.DEFINE_integer("steps", 6, "timed training steps with and without a write")
NPROC = flags.DEFINE_integer("nproc", 2, "gloo ranks")
PARTS = flags.DEFINE_list("parts", ["s3", "tier", "stall"], "s3, tier and / or stall")
BUCKET = "funcshard-bench"


def _setup(dim: int, layers: int):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    mesh = fs.make_mesh(device_type="cpu")
    opt = fs.optim.adamw(1e-3)
    state = fs.init(model, opt, mesh=mesh, strategy="optim_grads_params")

    def loss_fn(params, batch):
        return fs.functional_call(model, params, (batch,)).square().mean()

    def step(state):
        return fs.train_step(state, torch.randn(8, dim), loss_fn)[0]

    return step(state), step, lambda: fs.init(model, opt, mesh=mesh, strategy="optim_grads_params")


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def bench_s3(env: dict, root: str, dim: int, layers: int, reps: int) -> dict:
    os.environ.update(env)
    state, _, fresh = _setup(dim, layers)
    out = {}
    for where, base in (("path", root), ("s3", f"s3://{BUCKET}/bench")):
        saves, restores = [], []
        for rep in range(reps):
            target = f"{base}/{where}-{rep}"
            saves.append(_timed(lambda t=target: fs.save(t, state)))
            like = fresh()
            restores.append(_timed(lambda t=target, like=like: fs.restore(t, like=like)))
        out[where] = (min(saves), min(restores))
    return out


def bench_stall(root: str, dim: int, layers: int, steps: int) -> dict:
    """Each measure beside its peer in the same round (the machine's load drifts between
    rounds): a synchronous save beside a background one's stall; a step while the background
    write of the save just made runs beside the step before it, without one."""
    state, step, _ = _setup(dim, layers)
    sync_s, staged_s, during, quiet, written = [], [], [], [], []
    with (
        fs.CheckpointManager(os.path.join(root, "sync"), 1, async_save=False) as sync,
        fs.CheckpointManager(os.path.join(root, "async"), max_to_keep=1) as mgr,
    ):
        mgr.save(0, state)  # the first makes the saver's own gloo group and its buffers
        mgr.wait()
        for _ in range(steps):
            sync_s.append(_timed(lambda s=state: sync.save(s.step, s)))
            dist.barrier()
            t0 = time.perf_counter()
            state = step(state)
            quiet.append(time.perf_counter() - t0)
            dist.barrier()
            mgr.save(state.step, state)
            staged_s.append(mgr.last_save_stats()["staged_s"])
            t0 = time.perf_counter()
            state = step(state)
            during.append(time.perf_counter() - t0)
            mgr.wait()
            written.append(mgr.last_save_stats()["written_s"])
        nbytes = mgr.last_save_stats()["bytes"]
    med = statistics.median
    return {
        "sync_s": med(sync_s),
        "staged_s": med(staged_s),
        "staged_ratio": med([a / b for a, b in zip(staged_s, sync_s, strict=True)]),
        "written_s": med(written),
        "bytes": nbytes,
        "step_during_s": med(during),
        "step_quiet_s": med(quiet),
        "step_ratio": med([a / b for a, b in zip(during, quiet, strict=True)]),
    }


def bench_tier(env: dict, root: str, persistent: str, dim: int, layers: int, reps: int) -> dict:
    os.environ.update(env)
    state, _, fresh = _setup(dim, layers)
    kw = dict(local_dir=os.path.join(root, "tier-{node}"), ranks_per_node=2, async_save=False)
    with fs.CheckpointManager(persistent, **kw) as mgr:
        mgr.save(state.step, state)
        local, persistent = [], []
        for _ in range(reps):
            if dist.get_rank() == 0:  # node 1's tier lost
                shutil.rmtree(os.path.join(root, "tier-1"), ignore_errors=True)
            like = fresh()
            local.append(_timed(lambda like=like: mgr.restore(like=like)))
            like = fresh()
            persistent.append(_timed(lambda like=like: mgr.restore(state.step, like=like)))
            if dist.get_rank() == 2:  # node 1's tier back for the next rep
                shutil.rmtree(os.path.join(root, "tier-1"), ignore_errors=True)
            mgr.local.save(state.step + 1, state)
    return {"local_s": min(local), "persistent_s": min(persistent)}


RAW_MB = 8


def _raw_s3(env: dict, nbytes: int) -> tuple[float, float]:
    """Seconds to PUT, then GET, ``nbytes`` in RAW_MB objects through boto3 (no funcshard)."""
    import boto3

    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    body = os.urandom(RAW_MB << 20)
    n = max(1, nbytes // len(body))
    t0 = time.perf_counter()
    for i in range(n):
        client.put_object(Bucket=BUCKET, Key=f"raw/{i}", Body=body)
    put = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        client.get_object(Bucket=BUCKET, Key=f"raw/{i}")["Body"].read()
    return put, time.perf_counter() - t0


def main(argv: list[str]) -> None:
    del argv
    root = tempfile.mkdtemp(prefix="bench_storage_")
    n = NPROC.value
    mb = 3 * 4 * LAYERS.value * (DIM.value * DIM.value + DIM.value) / 1e6
    print(f"state: {mb:.0f} MB (AdamW ZeRO-3 masters + 2 moments, fp32) over {n} gloo ranks")
    try:
        if "s3" in PARTS.value:
            with local_s3(BUCKET) as env:
                r = fs.launch(bench_s3, env, root, DIM.value, LAYERS.value, REPS.value, nproc=n)
                raw_put, raw_get = _raw_s3(env, int(mb * 1e6))
            (ps, pr), (ss, sr) = r[0]["path"], r[0]["s3"]
            print(f"{'':10}{'path s':>10}{'s3 s':>10}{'s3/path':>10}")
            print(f"{'save':10}{ps:10.3f}{ss:10.3f}{ss / ps:10.2f}")
            print(f"{'restore':10}{pr:10.3f}{sr:10.3f}{sr / pr:10.2f}")
            print(
                f"the server's own floor: the same bytes PUT in {RAW_MB} MB objects by one client "
                f"{raw_put:.3f} s, GET {raw_get:.3f} s (save / floor {ss / raw_put:.2f}, "
                f"restore / floor {sr / raw_get:.2f})"
            )
        if "tier" in PARTS.value:
            with local_s3(BUCKET) as env:
                for name, persistent in (("s3", f"s3://{BUCKET}/tier"), ("path", root + "/p")):
                    r = fs.launch(
                        bench_tier,
                        env,
                        root,
                        persistent,
                        DIM.value,
                        LAYERS.value,
                        REPS.value,
                        nproc=4,
                    )[0]
                    print(
                        f"local tier, a node lost: restore {r['local_s']:.3f} s vs the "
                        f"persistent restore on {name} {r['persistent_s']:.3f} s "
                        f"({r['local_s'] / r['persistent_s']:.2f}x)"
                    )
        if "stall" in PARTS.value:
            r = fs.launch(bench_stall, root, DIM.value, LAYERS.value, STEPS.value, nproc=n)[0]
            print(
                f"stall (medians of {STEPS.value} rounds; ratios: the median of each round's): "
                f"staged {r['staged_s']:.4f} s vs a synchronous save {r['sync_s']:.3f} s "
                f"({r['staged_ratio']:.3f}x; {r['bytes'] / 1e6:.0f} MB this rank; the background "
                f"write {r['written_s']:.3f} s); a step while the write runs "
                f"{r['step_during_s']:.3f} s vs {r['step_quiet_s']:.3f} s without "
                f"({r['step_ratio']:.2f}x)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)

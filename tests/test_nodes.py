"""Real multi-node runs: 2 network-namespace nodes x 2 ranks under torchrun (c10d rendezvous).

HSDP (replicate across nodes, shard within) trains a few SGD-momentum fp32 steps and must equal
one plain-torch process on the concatenated global batch, and so must HFSDP (outer_strategy
"optim": the optimizer sharded across the nodes too). ``fs.init_from_env`` joins a restart with
the shared store; experiments/train.py, elastic (``--nnodes=1:2``), loses a node in the middle
of a save, finishes on the smaller world while the node comes back, and ends with the bits of
a run that lost nothing. Skipped, with the reason, only where network namespaces cannot be
made (not root, no iproute2, no netns support).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _nodes_job
import numpy as np
import pytest
import torch

import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import nodes  # noqa: E402

STEPS = 3
_WHY = nodes.unavailable()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"no network namespaces: {_WHY}")


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


# HFSDP: its gathers and reductions cross the link on both axes (HSDP's all-reduce is one of
# them); HSDP across pools is in test_hfsdp.py
@pytest.mark.parametrize("outer_strategy", ["optim"], ids=["hfsdp"])
def test_two_nodes_match_one_process(tmp_path, outer_strategy: str) -> None:
    out = tmp_path / "result.pt"
    argv = [
        os.path.join(ROOT, "tests", "_nodes_job.py"),
        f"--out={out}",
        f"--steps={STEPS}",
        "--shard=2",
        "--replicate=2",
        "--strategy=optim_grads_params",
        f"--outer_strategy={outer_strategy}",
    ]
    with nodes.Nodes(2, rate="1gbit") as net:
        run = net.torchrun(argv, nproc_per_node=2, env=_env(), log_dir=str(tmp_path))
        codes = run.wait(timeout=180)  # 27 s on a quiet 2-core machine, 83 s at load 60
        crossed = [net.counters(i) for i in range(2)]
    assert codes == [0, 0], run.tails()
    got = torch.load(out)
    assert got["world"] == 4
    ref = models.reference_run(
        models.make_model(seed=7), _nodes_job.torch_optimizer, STEPS, _nodes_job.LOCAL_ROWS * 4
    )
    err = models.max_rel_err(got["params"], ref["params"])
    assert err < 1e-4, f"params: relative error {err}"
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) / abs(b) < 1e-4, (got["losses"], ref["losses"])
    # The replicate axis really crossed the links: HSDP all-reduces every gradient shard.
    n_params = sum(p.numel() for p in ref["params"].values())
    assert all(c.tx_bytes > STEPS * n_params * 4 / 2 for c in crossed), crossed


# --- fs.init_from_env across nodes: restarts and membership changes ------------------------------

_JOB = os.path.join(ROOT, "tests", "_launch_job.py")
# Fast rounds: a lost node is dropped after 5 missed 1 s heartbeats (with 2, a loaded machine
# dropped live nodes: a peer then formed a round of its own instead of waiting, and no agent
# heard of a waiting node), a round closes 1 s after its minimum of nodes.
_FAST = {"last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 5}


def _inits(log_dir) -> list[tuple[str, ...]]:
    path = os.path.join(log_dir, "inits")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(line.split()) for line in f]


def _wait_for(predicate, run, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            run.stop()
            pytest.fail(f"no {what} within {seconds:.0f} s\n{run.tails()}")
        time.sleep(0.2)


def test_a_restart_across_nodes_with_the_shared_store(tmp_path) -> None:
    """Rank 1 (node B) dies; node A's rank is computing (not communicating), so A's agent
    stops it for the new round without counting a failure: the round's nodes hold restart
    counts 0 (A) and 1 (B), which split a key made of TORCHELASTIC_RESTART_COUNT in two (the
    old init_from_env hung here). Rank 0 joins 3 s late, so rank 1 meets the first round's
    entry in the agent's store first."""
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    with nodes.Nodes(2) as net:
        run = net.torchrun(
            [_JOB, str(tmp_path), "--die=0:1", "--idle=60", "--slow=0"],
            torchrun_args=["--max-restarts=1", "--monitor-interval=0.2"],
            rdzv_conf=_FAST, env=env, log_dir=str(tmp_path),
        )  # fmt: skip
        assert run.wait(timeout=150) == [0, 0], run.tails()
    rounds = [(attempt, rank, world, total) for attempt, _, rank, world, total in _inits(tmp_path)]
    assert sorted(rounds[2:]) == [("0", "0", "2", "2"), ("1", "1", "2", "2")], run.tails()


# --- The main job, elastic: a node lost after a checkpoint and rejoining, bit for bit -------------

_ELASTIC_JOB = os.path.join(ROOT, "tests", "_elastic_job.py")
_TRAIN = os.path.join(ROOT, "experiments", "train.py")
# A tiny GPT, 10 steps of G = 4 gradient chunks (1 row each), a checkpoint every 2 steps.
_ELASTIC = [
    "--n_layer=1", "--d_model=16", "--n_head=2", "--batch_size=4", "--seq_len=8",
    "--eval_batches=1", "--threads=1", "--warmup=2", "--log_every=1", "--steps=10",
    "--save_every=2", "--grad_chunks=4", "--deterministic", "--param_dtype=fp32",
    "--device=cpu", "--resume",
]  # fmt: skip


def _metrics(out_dir) -> tuple[list[dict], list[dict], dict]:
    """metrics.jsonl's step rows, start rows and summary."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in rows if "final_loss" in r)
    return [r for r in rows if "step" in r], [r for r in rows if "start" in r], summary


def _params(ckpt_step_dir) -> dict:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(ckpt_step_dir.parent) as mgr:  # a JAX user's way to read a step
        return mgr.restore(int(ckpt_step_dir.name))["params"]


def test_a_node_lost_and_rejoining_finishes_bit_identically(tmp_path) -> None:
    """experiments/train.py on 2 nodes x 2 ranks under torchrun --nnodes=1:2 (no shared store:
    torch 2.13 cannot take a node back with it), G = 4, deterministic, an asynchronous
    checkpoint every 2 steps. Node B is killed after step 6, in the middle of the step-6 save
    (no rank has written yet; checkpoint 4 is complete): node A restarts alone, resumes at step
    4 on 2 ranks (2 microbatches), saves 6 again and reaches step 7; B comes back: A's ranks
    are stopped and 4 ranks resume at 6 and finish. Every step's loss and grad norm, the
    held-out loss and the final params are bitwise those of a straight 4-rank run."""
    ref_dir, out, ckpt = tmp_path / "ref", tmp_path / "out", tmp_path / "ckpt"
    reference = subprocess.Popen(  # beside the elastic run, which mostly waits
        [sys.executable, _TRAIN, "--nproc=4", *_ELASTIC, f"--out_dir={ref_dir}",
         f"--checkpoint_dir={ref_dir / 'ckpt'}"],
        env={**_env(), "CUDA_VISIBLE_DEVICES": ""}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    kw = dict(
        nnodes="1:2", nproc_per_node=2, rdzv_conf=_FAST, env=env, log_dir=str(tmp_path),
        torchrun_args=["--max-restarts=3", "--monitor-interval=0.2"],
    )  # fmt: skip
    argv = [_ELASTIC_JOB, f"--hold_dir={tmp_path}", "--hold=6:4,7:2", *_ELASTIC,
            f"--out_dir={out}", f"--checkpoint_dir={ckpt}"]  # fmt: skip
    at = lambda step: (tmp_path / f"held{step}").exists()  # noqa: E731
    saved = lambda step: (ckpt / str(step) / "commit_success.txt").exists()  # noqa: E731
    try:
        with nodes.Nodes(2) as net:
            run = net.torchrun(argv, **kw)
            _wait_for(lambda: at(6) and saved(4), run, 120, "step 6 on 4 ranks, checkpoint 4")
            assert not saved(6)  # held until go6
            net.kill(1)
            (tmp_path / "go6").touch()  # node A's save threads write, and find B gone
            _wait_for(lambda: at(7) and saved(6), run, 120, "step 7 on 2 ranks, checkpoint 6")
            back = net.torchrun(argv, nodes=[1], **kw)
            both = nodes.NodesRun([run.procs[0], back.procs[0]], [run.logs[0], back.logs[0]])
            assert both.wait(timeout=120) == [0, 0], both.tails()
        ref_log, _ = reference.communicate(timeout=120)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert reference.returncode == 0, ref_log[-4000:]

    rows, starts, summary = _metrics(out)
    ref_rows, ref_starts, ref_summary = _metrics(ref_dir)
    assert [(r["start"], r["world"], r["microbatches"]) for r in starts] == [
        (0, 4, 1), (4, 2, 2), (6, 4, 1)
    ], starts  # fmt: skip
    assert [r["world"] for r in rows] == [4, 4, 4, 4, 2, 2, 4, 4, 4, 4]
    assert [r["world"] for r in ref_rows] == [4] * 10
    keys = ("step", "loss", "grad_norm", "nonfinite", "lr")
    for r, ref in zip(rows, ref_rows, strict=True):  # floats round-trip JSON exactly
        assert [r[k] for k in keys] == [ref[k] for k in keys], (r, ref)
    assert summary == ref_summary
    assert sorted(os.listdir(ckpt)) == ["10", "6", "8"]  # nothing left of the killed save
    got, want = _params(ckpt / "10"), _params(ref_dir / "ckpt" / "10")
    assert set(got) == set(want)
    for name, value in want.items():
        assert np.asarray(got[name]).tobytes() == np.asarray(value).tobytes(), name

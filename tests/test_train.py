"""experiments/train.py: the Markov floor, the data order, flag checks, a run and its resume,
the GPT split into pipeline stages."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import funcshard as fs  # noqa: E402
from experiments import data as data_lib  # noqa: E402
from experiments import trainer  # noqa: E402
from experiments.gpt import GPT, GPTConfig  # noqa: E402

SCRIPT = ROOT / "experiments" / "train.py"
TINY = [
    "--n_layer=1",
    "--d_model=16",
    "--n_head=2",
    "--batch_size=4",
    "--seq_len=8",
    "--eval_batches=1",
    "--threads=1",
    "--warmup=2",
    "--log_every=1",
]
FINAL = re.compile(r"^final loss (\d+\.\d+) nats/token, floor (\d+\.\d+), gap (-?\d+\.\d+)%$", re.M)


def _train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return _finish(_start_train(*args), timeout)


def _start_train(*args: str) -> subprocess.Popen:
    """``train.py`` with ``args`` started, its output captured: :func:`_finish` waits for it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _finish(p: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    """``p``'s outputs and exit code, as ``subprocess.run`` gives them; past ``timeout`` it is
    killed (``subprocess.TimeoutExpired``, as ``subprocess.run`` raises)."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _flags_config(args: list[str], monkeypatch) -> tuple[trainer.Config, int]:
    """The ``Config`` and world ``train.py`` launches for ``args`` (absl's parse and the
    script's checks in this process, the launch caught). This process's environment is as it
    was after (``--device=cpu`` hides CUDA before launching: a pool spawned next, kept for the
    session, would inherit that)."""
    from absl import flags

    from experiments import train

    launched = []
    with monkeypatch.context() as patch:
        patch.setattr(train.fs, "launch", lambda fn, cfg, nproc: launched.append((cfg, nproc)))
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # main sets it: restored on leaving
        try:
            flags.FLAGS(["train.py", *args])
            train.main(["train.py"])
        finally:
            flags.FLAGS.unparse_flags()
    ((cfg, nproc),) = launched
    return cfg, nproc


def _environment() -> dict[str, str]:
    """This process's environment but for what torch sets itself the first time anything asks
    for inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, exported for its workers):
    whether that happens in a test depends on the tests before it."""
    return {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}


def _pool_train(args: list[str], monkeypatch, pool_of) -> dict[str, Any]:
    """``train.py`` with ``args`` (``--device=cpu`` added) as the script launches it, but on the
    session pools' warm ranks: ``trainer.run`` of the ``Config`` its flags give
    (``_flags_config``), without a process per rank (~10 s of imports each). Returns rank 0's
    result after checking that every rank returned the same one."""
    import helpers_train

    env = _environment()
    cfg, nproc = _flags_config([*args, "--device=cpu"], monkeypatch)
    assert _environment() == env, "train.py's checks changed the environment a pool inherits"
    results = pool_of(nproc).run(helpers_train.run, cfg)
    assert all(r == results[0] for r in results), results
    return results[0]


# --- the floor -------------------------------------------------------------------------------


def test_entropy_rate_of_a_deterministic_chain_is_zero():
    V = 5
    P = np.zeros((V, V, V))
    for a in range(V):
        for b in range(V):
            P[a, b, (a + 2 * b + 1) % V] = 1.0
    assert data_lib.entropy_rate(P) == pytest.approx(0.0, abs=1e-12)


def test_entropy_rate_of_a_uniform_chain_is_log_vocab():
    V = 7
    uniform = np.full((V, V, V), 1.0 / V)
    assert data_lib.entropy_rate(uniform) == pytest.approx(math.log(V), rel=1e-12)


def test_entropy_rate_of_an_order_1_chain_matches_the_closed_form():
    # x_t depends on x_{t-1} only: a two-state chain with flip probabilities p and q has
    # stationary (q, p) / (p + q) and entropy rate (q H(p) + p H(q)) / (p + q).
    p, q = 0.1, 0.3
    T = np.array([[1 - p, p], [q, 1 - q]])
    P = np.broadcast_to(T, (2, 2, 2)).copy()
    H = lambda x: -x * math.log(x) - (1 - x) * math.log(1 - x)
    assert data_lib.entropy_rate(P) == pytest.approx((q * H(p) + p * H(q)) / (p + q), rel=1e-10)


def test_stationary_pairs_is_invariant_under_the_pair_chain():
    src = data_lib.make_markov(6, 0.2)
    pi = data_lib.stationary_pairs(src.transitions)
    np.testing.assert_allclose(np.einsum("ab,abc->bc", pi, src.transitions), pi, atol=1e-12)
    assert pi.sum() == pytest.approx(1.0)


def test_floor_matches_the_empirical_loss_of_the_true_model():
    src = data_lib.make_markov(8, 0.3)
    x = src.sample(np.random.default_rng(0), 400, 101)
    nll = -np.log(src.transitions[x[:, :-2], x[:, 1:-1], x[:, 2:]])
    stderr = nll.std() / math.sqrt(nll.size)
    assert abs(nll.mean() - src.floor) < 4 * stderr + 1e-3, (nll.mean(), src.floor, stderr)


# --- the data order --------------------------------------------------------------------------


def test_batches_are_a_function_of_seed_step_and_rank():
    src = data_lib.make_markov(16, 0.1, seed=3)
    full = src.batch(5, batch_size=8, seq_len=10)
    parts = [src.batch(5, batch_size=8, seq_len=10, rank=r, world=4) for r in range(4)]
    torch.testing.assert_close(torch.cat(parts), full)
    torch.testing.assert_close(
        data_lib.make_markov(16, 0.1, seed=3).batch(5, batch_size=8, seq_len=10), full
    )
    assert not torch.equal(src.batch(6, batch_size=8, seq_len=10), full)
    assert not torch.equal(
        data_lib.make_markov(16, 0.1, seed=4).batch(5, batch_size=8, seq_len=10), full
    )
    held_out = src.batch(5, batch_size=8, seq_len=10, stream=data_lib.EVAL)
    assert not torch.equal(held_out, full)


def test_text_source_windows_come_from_the_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij" * 20)
    src = data_lib.TextSource.from_file(path, seed=0)
    assert src.vocab == 10 and src.floor is None
    x = src.batch(0, batch_size=4, seq_len=5)
    assert x.shape == (4, 6)
    assert ((x[:, 1:] - x[:, :-1]) % 10 == 1).all()  # consecutive characters of the file


# --- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--strategy=zero9"], "--strategy"),
        (["--shard=3", "--replicate=1"], "--shard"),
        (["--offload_fraction=1.5"], "--offload_fraction"),
        (["--param_dtype=bf17"], "--param_dtype"),
        (["--grad_chunks=3"], "--grad_chunks=3 gradient chunks per step do not split over 2"),
        (["--param_comm_dtype=int4"], "--param_comm_dtype"),
        (["--tensor=2", "--n_head=3"], "--n_head=3 must be divisible by --tensor=2"),
        (["--expert=2"], "--expert=2 splits experts: pass --experts=N"),
        (["--expert=2", "--experts=3", "--top_k=1"], "--expert=2 must divide --experts=3"),
        (["--expert=4", "--experts=8"], "--expert=4 must divide the shard size 2"),
        (["--pipeline=2"], "--pipeline=2 with --tied: the output head tied"),
        (["--pipeline=2", "--notied", "--schedule=ZBVZeroBubble"], "--n_layer=2: a pipeline"),
        (["--pipeline=2", "--notied", "--nproc=4", "--context=2"], "with --context: not supported"),
        (
            ["--pipeline=2", "--notied", "--nproc=8", "--replicate=2", "--outer_strategy=optim"],
            "--outer_strategy=optim on --replicate=2 x shard size 2: not supported",
        ),
        (["--pipeline=3", "--notied"], "--pipeline=3 does not divide the world size 2"),
        (
            ["--pipeline=2", "--notied", "--n_layer=4", "--schedule=DualPipeV", "--microbatches=1"],
            "--schedule=DualPipeV with 1 microbatch",
        ),
    ],
)
def test_bad_flags_fail_before_launching_and_name_the_flag(args, flag, monkeypatch):
    # in this process (a python per case cost 5 s of imports): absl's parse, then main up to
    # the launch, which must not be reached; `_train` runs the script whole elsewhere
    from absl import flags

    from experiments import train

    def launched(*_: Any, **__: Any) -> None:
        raise AssertionError(f"{args}: launched ranks")

    monkeypatch.setattr(train.fs, "launch", launched)
    try:
        flags.FLAGS(["train.py", "--nproc=2", *args])
        train.main(["train.py"])
    except (flags.Error, SystemExit) as e:
        message = str(e)
    else:
        raise AssertionError(f"{args}: no error")
    finally:
        flags.FLAGS.unparse_flags()
    assert flag in message, message


# --- a run, and a resumed run ----------------------------------------------------------------


def _rows(out_dir: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step" in r], next(r for r in rows if "final_loss" in r)


def _checkpoint(path: Path) -> dict:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(path.parent) as mgr:  # a JAX user's way to read a step
        return mgr.restore(int(path.name))


def test_train_runs_and_resumes_on_another_world_bit_identically(tmp_path, monkeypatch, pool_of):
    """2 ranks straight; 2 ranks to step 3, then 1 rank from its checkpoint: --grad_chunks
    keeps G = 2 (1 then 2 microbatches) and --deterministic the bits. The run to step 3 is
    on the pools' warm ranks (``_pool_train``: only its checkpoint and rows are read); the
    straight run and the resumed one are the script's own processes (their logs are read).
    The straight run goes on beside the split one (they share nothing; its processes spend
    much of their time starting)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--steps=6", "--save_every=3", "--grad_chunks=2", "--deterministic", *TINY]

    straight = _start_train(
        *common, "--nproc=2", f"--checkpoint_dir={whole / 'ckpt'}", f"--out_dir={whole}"
    )
    try:
        ckpt = f"--checkpoint_dir={split / 'ckpt'}"
        b1 = _pool_train(
            [*common, "--nproc=2", "--stop_at=3", ckpt, f"--out_dir={split}"], monkeypatch, pool_of
        )
        b2 = _train(*common, "--nproc=1", "--resume", ckpt, f"--out_dir={split}")
    except BaseException:
        straight.kill()  # the split run failed: its error, not a wait for this one
        straight.communicate()
        raise
    a = _finish(straight)
    assert a.returncode == 0, a.stderr[-4000:]
    # The smoke test: the final line, the metrics and the plot.
    final = FINAL.search(a.stdout)
    assert final, a.stdout
    rows, summary = _rows(whole)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert float(final.group(1)) == pytest.approx(summary["final_loss"], abs=1e-4)
    assert (whole / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert b1["steps"] == 3, b1
    assert b2.returncode == 0, b2.stderr[-4000:]
    assert "1 ranks x 2 microbatches" in b2.stderr and "resumed at step 3" in b2.stderr
    assert re.search(r"step 4/6 .* world 1 ", b2.stderr), b2.stderr[-2000:]

    rows_b, summary_b = _rows(split)
    assert [r["world"] for r in rows] == [2] * 6
    assert [r["world"] for r in rows_b] == [2, 2, 2, 1, 1, 1]
    same = dict(tokens_per_s=0, time=0, step_s=0, world=0, comm=0, comm_by_axis=0)  # its own
    for r, rb in zip(rows, rows_b, strict=True):  # the same steps, up to speed, time, world
        assert dict(r, **same) == dict(rb, **same)
    assert summary_b == summary  # the held-out loss too (deterministic: chunked as training)
    starts = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    starts = [(r["start"], r["world"], r["microbatches"]) for r in starts if "start" in r]
    assert starts == [(0, 2, 1), (3, 1, 2)]
    assert FINAL.search(b2.stdout).group(0) == final.group(0)
    ckpt_a, ckpt_b = _checkpoint(whole / "ckpt" / "6"), _checkpoint(split / "ckpt" / "6")
    assert ckpt_a["step"] == ckpt_b["step"] == 6
    assert set(ckpt_a["params"]) == set(ckpt_b["params"])
    for name, value in ckpt_a["params"].items():
        np.testing.assert_array_equal(
            np.asarray(value), np.asarray(ckpt_b["params"][name]), err_msg=name
        )


HFSDP = ("--nproc=4", "--replicate=2", "--outer_strategy=optim")
TINY_MODEL = GPTConfig(vocab=16, seq_len=8, n_layer=1, n_head=2, d_model=16)  # TINY's model
WIRES = {"none": None, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _planned(mesh: tuple[str, ...], grad_wire: str, param_wire: str) -> fs.Plan:
    """fs.plan of TINY's run on ``mesh`` (fp32 compute) with these wires."""
    flags = dict(arg.removeprefix("--").split("=") for arg in mesh)
    with torch.device("meta"):
        model = GPT(TINY_MODEL)
    policy = fs.MixedPrecisionPolicy(
        param_dtype=torch.float32,
        grad_comm_dtype=WIRES[grad_wire],
        param_comm_dtype=WIRES[param_wire],
    )
    return fs.plan(
        model,
        world_size=int(flags["nproc"]),
        replicate=int(flags.get("replicate", 1)),
        outer_strategy=flags.get("outer_strategy", "no_shard"),
        policy=policy,
        optimizer=trainer.make_optimizer(trainer.Config(model=TINY_MODEL, steps=3, warmup=2)),
        device_type="cpu",
    )


@pytest.mark.parametrize(
    "grad_wire,param_wire,mesh",
    [("int8", "fp8", ("--nproc=2",)), ("bf16", "int8", ("--nproc=2",)), ("int8", "int8", HFSDP)],
    ids=["int8-fp8", "bf16-int8", "hfsdp-int8-int8"],
)
def test_train_runs_with_low_precision_wires(
    tmp_path, grad_wire, param_wire, mesh, monkeypatch, pool_of
):
    """The wire flags reach the policy: every step's bytes per collective kind and mesh axis
    (metrics.jsonl) equal fs.plan's with those wires; a bf16 gradient wire moves half of fp32's
    reduce bytes, an 8-bit one a quarter plus a scale per row (on these 16-wide rows, under a
    half). On the pools' warm ranks (``_pool_train``)."""
    args = [*mesh, "--steps=3", *TINY, "--param_dtype=fp32", f"--out_dir={tmp_path}"]
    wires = [f"--grad_comm_dtype={grad_wire}", f"--param_comm_dtype={param_wire}"]
    done = _pool_train([*args, *wires], monkeypatch, pool_of)
    rows, summary = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and done["steps"] == summary["steps"] == 3
    assert math.isfinite(done["final_loss"]) and done["final_loss"] == summary["final_loss"]
    wire, fp32 = _planned(mesh, grad_wire, param_wire), _planned(mesh, "none", "none")
    nonzero = lambda counts: {k: v for k, v in counts.items() if v}  # noqa: E731
    for row in rows:
        assert row["comm"] == nonzero(wire.comm), (row["step"], row["comm"], wire.comm)
        assert row["comm_by_axis"] == nonzero(wire.comm_by_axis), row
    grads = lambda comm: comm.get("reduce_scatter", 0) + comm.get("all_reduce", 0)  # noqa: E731
    moved, full = grads(rows[-1]["comm"]), grads(fp32.comm)
    if grad_wire == "bf16":
        assert 2 * moved == full, (moved, full)
    else:
        assert full / 4 < moved < full / 2, (moved, full)
    gathered, full = rows[-1]["comm"]["all_gather"], fp32.comm["all_gather"]
    assert full / 4 < gathered < full / 2, (gathered, full)  # both param wires are 8-bit


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested checkpoint dict flattened to {"a.b.c": leaf}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _leaves(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


DTYPE_NAMES = {"int8": "int8", "uint8": "uint8", "bf16": "bfloat16", "fp16": "float16"}


@pytest.mark.parametrize(
    "optimizer,mu,nu,d_model",
    [("adamw", "int8", "uint8", 64), ("muon", "bf16", "fp16", 16)],
    ids=["adamw-int8-uint8", "muon-bf16-fp16"],
)
def test_train_stores_moments_in_the_flagged_dtypes(
    tmp_path, optimizer, mu, nu, d_model, monkeypatch, pool_of
):
    """--mu_dtype / --nu_dtype reach the optimizer: the saved moments have those dtypes
    (AdamW's mu and nu, Muon's momentum); 8-bit where a leaf is >= 2-D with >= 4096 elements
    (at d_model 64 the blocks' matrices; fp32 elsewhere), with its scales beside it. On the
    pools' warm ranks (``_pool_train``)."""
    args = [
        "--nproc=2",
        "--steps=2",
        *TINY,
        f"--d_model={d_model}",  # after TINY's: the last one given counts
        f"--optimizer={optimizer}",
        f"--mu_dtype={mu}",
        f"--nu_dtype={nu}",
        "--save_every=2",
        f"--checkpoint_dir={tmp_path / 'ckpt'}",
        f"--out_dir={tmp_path}",
    ]
    assert _pool_train(args, monkeypatch, pool_of)["steps"] == 2
    leaves = _leaves(_checkpoint(tmp_path / "ckpt" / "2"))
    shapes = {n.removeprefix("params."): v.shape for n, v in leaves.items() if n[:7] == "params."}
    stored = {"mu": {}, "nu": {}, "momentum": {}}  # moment -> {param name: stored dtype}
    for name, value in leaves.items():
        for moment, dtypes in stored.items():
            if f".{moment}." in name:
                dtypes[name.split(f".{moment}.", 1)[1]] = str(value.dtype)
    muon = {n for n, shape in shapes.items() if trainer.is_hidden_matrix(n, shape)}
    if optimizer == "muon":  # the blocks' matrices take Muon (its momentum: mu_dtype)
        assert set(stored["momentum"]) == muon
        assert set(stored["mu"]) == set(stored["nu"]) == set(shapes) - muon
    else:
        assert not stored["momentum"] and set(stored["mu"]) == set(stored["nu"]) == set(shapes)
    eight_bit = lambda n: len(shapes[n]) >= 2 and math.prod(shapes[n]) >= 4096  # noqa: E731
    moments = [("mu", mu), ("nu", nu)] + [("momentum", mu)] * (optimizer == "muon")
    for moment, flag in moments:
        blockwise = flag in ("int8", "uint8")
        expected = {
            n: DTYPE_NAMES[flag] if not blockwise or eight_bit(n) else "float32"
            for n in stored[moment]
        }
        assert stored[moment] == expected, moment
        if blockwise:
            assert any(eight_bit(n) for n in stored[moment])  # the 8-bit format is exercised
            for n in filter(eight_bit, stored[moment]):
                assert any(leaf.endswith(f".{moment}_scale.{n}") for leaf in leaves), n


def test_train_compiles_its_blocks_with_the_eager_runs_results(tmp_path, monkeypatch, pool_of):
    """``--compile=aot_eager`` compiles each block in place (ZeRO-3, the main job's default
    strategy): the same losses and grad norms as the eager run (AOTAutograd adds the gradient
    contributions in the same order here: bitwise, as tests/test_compile.py measures), the first
    step's compile logged, every step's wall time in metrics.jsonl. The compiled run is the
    script's own (its ranks' log, a fresh process's compile); the eager one runs on the pools'
    warm ranks (``_pool_train``)."""
    args = ["--nproc=2", "--steps=3", *TINY, "--param_dtype=fp32"]
    _pool_train([*args, f"--out_dir={tmp_path / 'eager'}"], monkeypatch, pool_of)
    out = _train(*args, "--compile=aot_eager", f"--out_dir={tmp_path / 'compiled'}")
    assert out.returncode == 0, out.stderr[-4000:]
    (eager, _), (compiled, _) = _rows(tmp_path / "eager"), _rows(tmp_path / "compiled")
    log = out.stderr
    assert [(r["loss"], r["grad_norm"]) for r in compiled] == [
        (r["loss"], r["grad_norm"]) for r in eager
    ]
    assert "first step" in log and "compiling the blocks: aot_eager" in log, log[-2000:]
    assert all(r["step_s"] > 0 for r in compiled + eager)


def test_train_captures_the_step_and_logs_each_graphs_compile(tmp_path):
    """``--compile=aot_eager --compile_by=fs`` gives the backend to ``fs.init(compile=)``
    (ZeRO-3: the captured step): the run finishes, and the log names the capture and each
    graph's compile time (one forward and one backward graph)."""
    out = _train(
        "--nproc=2",
        "--steps=2",
        *TINY,
        "--param_dtype=fp32",
        "--compile=aot_eager",
        "--compile_by=fs",
        f"--out_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "compiling the captured step: aot_eager" in out.stderr, out.stderr[-2000:]
    assert "compile time: 1 forward graph(s)" in out.stderr, out.stderr[-2000:]
    assert "1 backward graph(s)" in out.stderr, out.stderr[-2000:]


def _same_runs(tmp_path, runs: dict[str, list[str]], steps: int, monkeypatch, pool_of) -> dict:
    """``train.py`` with each of ``runs``' arguments (fp32, tiny) on the pools' warm ranks
    (``_pool_train``), its rows and summary, after checking that it ran every step and that
    every step's loss and grad norm and the held-out loss agree to fp32 rounding (1e-5: the
    runs differ in summation order only)."""
    out = {}
    for name, args in runs.items():
        out_dir = tmp_path / name
        fp32 = ["--param_dtype=fp32", f"--out_dir={out_dir}"]
        done = _pool_train([*args, f"--steps={steps}", *TINY, *fp32], monkeypatch, pool_of)
        out[name] = _rows(out_dir)
        assert [r["step"] for r in out[name][0]] == list(range(1, steps + 1)), name
        assert done["final_loss"] == out[name][1]["final_loss"], name
    (rows_a, final_a), (rows_b, final_b) = out.values()
    for a, b in zip(rows_a, rows_b, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert final_a["final_loss"] == pytest.approx(final_b["final_loss"], rel=1e-5)
    return out


def test_train_with_tensor_parallel_blocks_equals_the_data_parallel_run(
    tmp_path, monkeypatch, pool_of
):
    """``--tensor=2 --nproc=4`` (each block's heads and MLP split by ``gpt.tensor_plan``, a
    tensor group sharing its batch: the same 2 data-parallel ranks) trains as ``--nproc=2``:
    the same losses and grad norms to fp32 rounding (TP changes the matmuls' summation order
    only), and the held-out loss of the full params."""
    runs = {"dp": ["--nproc=2"], "tp": ["--nproc=4", "--tensor=2"]}
    runs = _same_runs(tmp_path, runs, 3, monkeypatch, pool_of)
    tp_rows, _ = runs["tp"]
    assert tp_rows[0]["comm_by_axis"].get("tensor", 0) > 0  # the norm's sum over "tensor"


def test_train_with_expert_parallel_experts_equals_the_dense_moe_run(
    tmp_path, monkeypatch, pool_of
):
    """``--experts=4 --expert=2`` (each block's experts split over mesh["expert"] by
    ``fs.ExpertParallel``, tokens routed by all-to-all) trains as the same MoE GPT without the
    expert axis: the same losses, grad norms and held-out loss to fp32 rounding, and the
    all-to-all counted on "expert"."""
    moe = ["--nproc=2", "--experts=4"]
    runs = _same_runs(tmp_path, {"dense": moe, "ep": [*moe, "--expert=2"]}, 2, monkeypatch, pool_of)
    (dense_rows, _), (ep_rows, _) = runs["dense"], runs["ep"]
    assert ep_rows[0]["comm_by_axis"].get("expert", 0) > 0
    assert "expert" not in dense_rows[0]["comm_by_axis"]


def test_gpt_splits_into_stages_that_compose_to_the_whole_model():
    """fs.pipeline.split's stages of the GPT (removed modules: nn.Identity) run only what they
    hold: untied, stage 1 on stage 0's hidden states gives the whole model's logits (a removed
    position embedding is not added); tied, the stage with the head but not the embedding it
    is tied to refuses, naming tok_emb (never a second copy of it)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 16, (3, 8))
    untied = GPT(dataclasses.replace(TINY_MODEL, n_layer=2, tied=False))
    first, second = fs.pipeline.split(untied, ["blocks.1"])
    assert isinstance(second.pos_emb, torch.nn.Identity)  # removed, as split removes it
    torch.testing.assert_close(second(first(tokens)), untied(tokens), rtol=0, atol=0)
    first, second = fs.pipeline.split(GPT(dataclasses.replace(TINY_MODEL, n_layer=2)), ["blocks.1"])
    with pytest.raises(ValueError, match="not tok_emb, whose weight the head is tied to"):
        second(first(tokens))


def _starts(out_dir: Path) -> list[tuple[int, int, int]]:
    """Each start row of ``out_dir``'s metrics.jsonl: (its step, world, microbatches)."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["start"], r["world"], r["microbatches"]) for r in rows if "start" in r]


def test_train_resumes_a_pipelined_run_in_a_plain_one(tmp_path, monkeypatch, pool_of):
    """``--pipeline=2`` (2 stages, 2 microbatches) saves whole-model names at step 2; a plain
    ``--nproc=1`` run restores that checkpoint and trains steps 3-4 as the pipelined run
    did uninterrupted (loss, grad norm, held-out loss within 1e-5: the stages sum in another
    order). On the pools' warm ranks (``_pool_train``)."""
    model = ["--n_layer=2", "--notied", "--param_dtype=fp32", "--steps=4", "--save_every=2"]
    piped, plain = tmp_path / "piped", tmp_path / "plain"
    a = [*TINY, *model, "--nproc=2", "--pipeline=2"]
    a += [f"--checkpoint_dir={piped / 'ckpt'}", f"--out_dir={piped}"]
    assert _pool_train(a, monkeypatch, pool_of)["start_step"] == 0
    assert _starts(piped) == [(0, 2, 2)]  # 2 ranks x 2 microbatches
    names = {
        n for n, _ in GPT(dataclasses.replace(TINY_MODEL, n_layer=2, tied=False)).named_parameters()
    }
    assert set(_checkpoint(piped / "ckpt" / "2")["params"]) == names  # the whole model's
    shutil.copytree(piped / "ckpt" / "2", plain / "ckpt" / "2")
    b = [*TINY, *model, "--nproc=1", "--resume"]  # the global batch whatever the world
    b += [f"--checkpoint_dir={plain / 'ckpt'}", f"--out_dir={plain}"]
    assert _pool_train(b, monkeypatch, pool_of)["start_step"] == 2  # resumed at step 2
    assert _starts(plain) == [(2, 1, 1)]
    (rows_a, final_a), (rows_b, final_b) = _rows(piped), _rows(plain)
    assert [r["step"] for r in rows_b] == [3, 4]
    assert "pipeline" in rows_a[0]["comm_by_axis"] and "pipeline" not in rows_b[0]["comm_by_axis"]
    for ra, rb in zip(rows_a[2:], rows_b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra, rb)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-5), (ra, rb)
    assert final_b["final_loss"] == pytest.approx(final_a["final_loss"], rel=1e-5)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check_resumed(run: Path, ref: Path) -> float:
    """``run`` (resumed at step 2 from ``ref``'s checkpoint) went on as ``ref`` did: steps
    3-4's losses and grad norms, the held-out loss and the step-4 params within 1e-5, the
    buffers (the routers' bias, moved by integer loads) bitwise; returns the largest
    relative param error."""
    (rows, final), (rows_ref, final_ref) = _rows(run), _rows(ref)
    assert [r["step"] for r in rows] == [3, 4], (run.name, rows)
    assert "pipeline" in rows[0]["comm_by_axis"], (run.name, rows[0])
    for r, rr in zip(rows, rows_ref[2:], strict=True):
        assert r["loss"] == pytest.approx(rr["loss"], rel=1e-5), (run.name, r, rr)
        assert r["grad_norm"] == pytest.approx(rr["grad_norm"], rel=1e-5), (run.name, r, rr)
    got, want = _checkpoint(run / "ckpt" / "4"), _checkpoint(ref / "ckpt" / "4")
    assert set(got["params"]) == set(want["params"]), run.name
    # not the keys' bias: its gradient is 0 in exact arithmetic (a score's softmax over the
    # keys does not see q . b_k), and AdamW turns its rounding noise into whole steps
    err = max(
        _rel(np.asarray(v), np.asarray(want["params"][n]))
        for n, v in got["params"].items()
        if not n.endswith(".k.bias")
    )
    assert err < 1e-5, (run.name, err)
    assert bool(want.get("buffers")) == (ref.name == "moe"), (run.name, list(want))
    for n, v in want.get("buffers", {}).items():
        assert np.asarray(v).any(), (run.name, n)  # moved by the loads of steps 1-4
        np.testing.assert_array_equal(np.asarray(got["buffers"][n]), np.asarray(v), n)
    assert final["final_loss"] == pytest.approx(final_ref["final_loss"], rel=1e-5), run.name
    return err


def test_train_pipelines_tensor_experts_deterministic_and_hfsdp_as_plain_runs(
    tmp_path, monkeypatch, pool_of
):
    """``--pipeline=2`` with ``--tensor=2``, with ``--experts=4 --expert=2``, and with
    ``--outer_strategy=optim`` (HFSDP over 2 replicas), each with ``--deterministic``,
    restores a plain run's step-2 checkpoint (no pipeline) and trains steps 3-4 as that run
    went on: the losses, grad norms and held-out loss within 1e-5 (fp32: the stages, tensor
    shards and microbatches sum in another order; the relative rounding of a few fp32 sums
    is ~1e-7), the step-4 checkpoint's params within 1e-5 and the MoE routers' bias
    (DeepSeek-V3's update from the step's global load, which the pipelined loop sums over
    every stage's blocks) bitwise the plain run's. train.py's flags to ``Config`` in this
    process, ``trainer.run`` on the session pools' warm ranks (5 runs)."""
    import helpers_train

    model = [*TINY, "--n_layer=2", "--notied", "--param_dtype=fp32", "--device=cpu", "--steps=4"]
    moe = ["--experts=4", "--expert=2", "--deterministic"]
    plain = {
        "dense": ["--nproc=2", "--replicate=2", "--outer_strategy=optim", "--deterministic"],
        "moe": ["--nproc=2", *moe],
    }
    piped = {  # name: (its plain run, its flags)
        "hfsdp": ("dense", ["--replicate=2", "--outer_strategy=optim", "--deterministic"]),
        "tensor": ("dense", ["--tensor=2", "--deterministic"]),
        "experts": ("moe", moe),
    }
    for name, args in plain.items():
        where = [f"--out_dir={tmp_path / name}", f"--checkpoint_dir={tmp_path / name / 'ckpt'}"]
        cfg, nproc = _flags_config([*model, *args, *where, "--save_every=2"], monkeypatch)
        pool_of(nproc).run(helpers_train.run, cfg)
    for name, (ref, args) in piped.items():
        shutil.copytree(tmp_path / ref / "ckpt" / "2", tmp_path / name / "ckpt" / "2")
        where = [f"--out_dir={tmp_path / name}", f"--checkpoint_dir={tmp_path / name / 'ckpt'}"]
        flags = [*model, "--nproc=4", "--pipeline=2", *args, *where, "--save_every=2", "--resume"]
        cfg, nproc = _flags_config(flags, monkeypatch)
        assert (cfg.pipeline, cfg.microbatches, nproc) == (2, 2, 4), cfg
        pool_of(nproc).run(helpers_train.run, cfg)
        err = _check_resumed(tmp_path / name, tmp_path / ref)
        print(name, "largest relative param error", err)

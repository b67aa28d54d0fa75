"""Live fault tolerance across replica groups (``fs.FaultTolerance``, torchft).

A torchft lighthouse on a free port and replica groups of 2 gloo ranks each, every group its
own pair of processes (``tests/_ft_job.py``). The records each rank writes say which groups
committed which step; the run must equal a single-process replay that averages, step by
step, the gradients of exactly those groups.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import funcshard as fs

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _ft_job  # noqa: E402

import models  # noqa: E402

try:
    import torchft  # noqa: F401

    HAVE_TORCHFT = True
except ImportError:
    HAVE_TORCHFT = False

needs_torchft = pytest.mark.skipif(
    not HAVE_TORCHFT, reason='torchft is not installed (pip install "funcshard[ft]")'
)
# seconds a whole run may take before the test gives up on it (process starts included, a
# few seconds each on a quiet machine, far more on a loaded one); FUNCSHARD_POOL_TIMEOUT sets
# it, as it does the rank pools'
TIMEOUT = float(os.environ.get("FUNCSHARD_POOL_TIMEOUT", "240"))
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# torchft's timeout of the runs where a group is lost or fails on purpose: a peer's broken
# all-reduce waits it out, a quorum twice as long
SHORT = 5.0


def lighthouse_binary() -> str:
    near = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = near if os.path.exists(near) else shutil.which("torchft_lighthouse")
    assert found, "torchft is installed but its torchft_lighthouse binary was not found"
    return found


class Lighthouse:
    """A lighthouse on a free port (1 s heartbeat timeout, a short join wait)."""

    def __init__(self, root: str, min_replicas: int) -> None:
        from funcshard.distributed.launch import free_port

        port = free_port()
        self.address = f"http://127.0.0.1:{port}"
        cmd = [lighthouse_binary(), "--min_replicas", str(min_replicas)]
        cmd += ["--bind", f"127.0.0.1:{port}", "--heartbeat_timeout_ms", "1000"]
        cmd += ["--join_timeout_ms", "1000"]
        self.log = open(os.path.join(root, "lighthouse.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_listening(port)

    def _wait_listening(self, port: int, limit_s: float = 60.0) -> None:
        """Returns once the lighthouse accepts connections: a client that comes first is
        refused at once (torchft's manager connects within 1 s), which a loaded machine hit."""
        import socket
        import time

        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the lighthouse exited ({self.proc.returncode})"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise AssertionError(f"the lighthouse did not listen on port {port} within {limit_s} s")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture
def lighthouse(tmp_path):
    made = []

    def make(min_replicas: int, root: str | None = None) -> Lighthouse:
        made.append(Lighthouse(root or str(tmp_path), min_replicas))
        return made[-1]

    yield make
    for lh in made:
        lh.close()


def wait_all(procs: list[subprocess.Popen], root: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a group did not finish in {TIMEOUT} s:\n{logs(root)}")


def logs(root: str) -> str:
    """The last lines of every rank's log under ``root`` (its groups, or its runs' groups)."""
    text = []
    for here, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files) if os.path.basename(here)[:1] == "g" else []:
            if name.endswith(".log"):
                with open(os.path.join(here, name)) as f:
                    where = os.path.relpath(os.path.join(here, name), root)
                    text.append(f"--- {where}\n" + "".join(f.readlines()[-15:]))
    return "\n".join(text)


def records(root: str, group: int, rank: int) -> list[dict]:
    with open(os.path.join(root, f"g{group}", f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def committed_groups(root: str, groups: int) -> dict[int, list[int]]:
    """Per committed step, the groups whose gradients it averaged (from rank 0's records),
    checked against the step's "replicas" and against rank 1's records."""
    by_step: dict[int, list[int]] = {}
    for g in range(groups):
        for rank in (0, 1):
            for r in records(root, g, rank):
                if r["kind"] == "step" and r["committed"] and rank == 0:
                    by_step.setdefault(r["step"], []).append(g)
        steps = [(r["step"], r["committed"]) for r in records(root, g, 0) if r["kind"] == "step"]
        assert steps == [
            (r["step"], r["committed"]) for r in records(root, g, 1) if r["kind"] == "step"
        ], f"group {g}'s ranks disagree on what was committed"
    for g in range(groups):
        for r in records(root, g, 0):
            if r["kind"] == "step" and r["committed"]:
                assert r["replicas"] == len(by_step[r["step"]]), (r, by_step[r["step"]])
    return by_step


def replay(by_step: dict[int, list[int]], steps: int) -> dict[str, torch.Tensor]:
    """Plain torch in one process: each step's gradient is the mean over the step's groups of
    the gradient of the group's global batch; SGD with momentum."""
    model = copy.deepcopy(models.make_model(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=_ft_job.LR, momentum=_ft_job.MOMENTUM)
    for step in range(steps):
        groups = by_step[step]
        opt.zero_grad()
        for g in groups:
            batch = _ft_job.batch_for(g, step)
            loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"]) / len(groups)
            loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def check_replay(root: str, groups: list[int], by_step: dict[int, list[int]], steps: int):
    assert sorted(by_step) == list(range(steps)), f"committed steps {sorted(by_step)}"
    want = replay(by_step, steps)
    for g in groups:
        got = torch.load(os.path.join(root, f"g{g}", "final.pt"))
        for name, p in want.items():
            # fp32: the sums of 2 ranks' and 2 groups' means round in another order than
            # autograd's; a few ulps per step on values of order 1, far below one group's
            # gradient missing or counted twice (lr * grad, ~1e-2 here)
            torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-5, msg=name)


def wait_for(root: str, group: int, kind: str) -> None:
    """Until rank 0 of ``group`` wrote a line of ``kind``."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        path = os.path.join(root, f"g{group}", "rank0.jsonl")
        if os.path.exists(path) and any(r["kind"] == kind for r in records(root, group, 0)):
            return
        time.sleep(0.2)
    pytest.fail(f"group {group} wrote no {kind!r} line in {TIMEOUT} s:\n{logs(root)}")


def check_ends_equal(root: str, groups: list[int]) -> None:
    for rank in (0, 1):
        finals = {
            g: [r for r in records(root, g, rank) if r["kind"] == "final"][-1] for g in groups
        }
        assert len({(f["step"], f["hash"]) for f in finals.values()}) == 1, finals


@needs_torchft
def test_two_groups_of_every_strategy_start_recover_and_equal_the_replay(tmp_path, lighthouse):
    # groups that start together: at step 0 torchft heals one rank of each group from the
    # other group and not the other rank; under ZeRO-1/2 a healing rank derives its compute
    # params by an all-gather its group must join (#43). Both ranks of group 1 raise in the
    # loss of step 1 (after its quorum), catch it and call again: group 0 waits out its
    # all-reduce, and both must meet in a later quorum and commit every step together, not
    # stay wedged on a failed quorum (#43). Every strategy at once, each its own two groups
    # and lighthouse: a run is mostly process starts and quorum waits. Its 16 processes start
    # at once: on 2 loaded cores a group joined 10.4 s after its peer, past the join's quorum
    # timeout at fs.init (2 x torchft's timeout), so these runs wait twice SHORT.
    steps, runs, timeout = 3, {}, 2 * SHORT
    for strategy in STRATEGIES:
        root = str(tmp_path / strategy)
        os.makedirs(root)
        lh = lighthouse(min_replicas=2, root=root)
        runs[strategy] = [
            *_ft_job.start_group(root, 0, steps, lh.address, strategy=strategy, timeout=timeout),
            *_ft_job.start_group(
                root, 1, steps, lh.address, strategy=strategy, timeout=timeout, raise_at=1
            ),
        ]
    wait_all([p for procs in runs.values() for p in procs], str(tmp_path))
    for strategy, procs in runs.items():
        root = str(tmp_path / strategy)
        assert all(p.returncode == 0 for p in procs), (strategy, logs(root))
        for rank in (0, 1):
            errors = [r for r in records(root, 1, rank) if r["kind"] == "error"]
            assert [r["step"] for r in errors] == [1], (strategy, errors)
        by_step = committed_groups(root, 2)
        assert all(groups == [0, 1] for groups in by_step.values()), (strategy, by_step)
        check_ends_equal(root, [0, 1])
        check_replay(root, [0, 1], by_step, steps)
        check_bytes_equal_the_plan(root, [0, 1])


def check_bytes_equal_the_plan(root: str, groups: list[int]) -> None:
    """Every committed step of two groups moved the bytes per axis fs.plan predicts, the
    cross-group all-reduce under "replicas" (#43)."""
    for g in groups:
        # a step whose quorum healed a rank of the group also moves the all-gather that
        # derives the healing rank's compute params (#43): not the plan's step. Step 0 heals
        # one rank of each group, in fs.init's quorum or, on a loaded machine, in step 0's (its
        # metrics say "healed" only when the step moved): steps 0 and healed ones are left out.
        healed = {0} | {
            r["step"]
            for rank in (0, 1)
            for r in records(root, g, rank)
            if r["kind"] == "step" and r["healed"]
        }
        for rank in (0, 1):
            mine = records(root, g, rank)
            planned = {k: v for k, v in mine[0]["planned"].items() if v}
            assert planned["replicas"] > 0, planned
            checked = [
                r
                for r in mine
                if r["kind"] == "step"
                and r["committed"]
                and r["replicas"] == 2
                and r["step"] not in healed
            ]
            assert checked, (g, rank, mine)
            for r in checked:
                assert r["by_axis"] == planned, (g, rank, r, planned)


@needs_torchft
def test_a_killed_group_heals_even_after_a_stale_restore_while_the_survivor_waits(
    tmp_path, lighthouse
):
    # min_replicas=2 at the lighthouse: the groups start together, and the survivor, never
    # restarted, waits in its next quorum for the restarted group (min_replicas=1 lets it go
    # on alone: experiments/bench_ft.py measures that). The group restarts only once the
    # survivor's quorum timed out: its next call must ask the lighthouse again, not re-raise
    # the old timeout (torchft keeps a failed quorum; #43). The restarted group heals to the
    # survivor's step in fs.init, then restores an older checkpoint (the README's recipe):
    # its first step must not reuse init's quorum (the survivor would average gradients of
    # stale weights into a committed step), and the heal in that step moves its step: it
    # returns the peers' state, computing nothing on the batch built for the old step (#43).
    root, steps, kill_at = str(tmp_path), 6, 3
    lh = lighthouse(min_replicas=2)
    # every group counts its rows with fs.summed: a committed step's total is every group's
    survivor = _ft_job.start_group(root, 0, steps, lh.address, timeout=SHORT, summed=True)
    victim = _ft_job.start_group(
        root, 1, steps, lh.address, kill_at=kill_at, timeout=SHORT, summed=True
    )
    for p in victim:
        p.wait(timeout=TIMEOUT)
    assert all(p.returncode == -signal.SIGKILL for p in victim), logs(root)
    wait_for(root, 0, "timeout")
    restarted = _ft_job.start_group(
        root, 1, steps, lh.address, timeout=SHORT, stale=True, summed=True
    )
    wait_all(survivor + restarted, root)
    assert all(p.returncode == 0 for p in survivor + restarted), logs(root)

    for rank in (0, 1):
        mine = records(root, 0, rank)
        # the survivor never restarted: one process for the whole run
        assert len({r["pid"] for r in mine}) == 1
        assert sum(r["kind"] == "init" for r in mine) == 1
        # its step broken by the kill returned the input state's values bitwise
        lost = [r for r in mine if r["kind"] == "step" and not r["committed"]]
        assert lost, "no step of the survivor was broken by the kill"
        assert all(r["before"] == r["after"] and r["step"] == kill_at for r in lost), lost
        # its quorum timed out while the group was down, and a later one formed
        timeouts = [r for r in mine if r["kind"] == "timeout"]
        assert timeouts and all(r["step"] == kill_at for r in timeouts), timeouts
        # the restarted group healed bitwise to the state the survivor then stepped
        init = [r for r in records(root, 1, rank) if r["kind"] == "init"][-1]
        assert init["step"] == kill_at, init
        served = [r for r in mine if r["kind"] == "step" and r["step"] == init["step"]]
        assert init["hash"] in {r["before"] for r in served}, (init, served)
        # the stale state's step (1) was refused: healed, not committed, not computed
        steps_after = [
            r for r in records(root, 1, rank) if r["kind"] == "step" and r["t"] > init["t"]
        ]
        first = steps_after[0]
        assert first["step"] == 1 and first["healed"] == 1 and not first["committed"], first
        assert first["after"] == init["hash"], "the heal gave the survivor's state again"
    by_step = committed_groups(root, 2)
    for g in (0, 1):  # fs.summed counted every group's rows, each once (#52)
        for rank in (0, 1):
            for r in records(root, g, rank):
                if r["kind"] == "step" and r["committed"]:
                    assert r["rows"] == [_ft_job.ROWS * r["replicas"]], (g, rank, r)
    check_ends_equal(root, [0, 1])
    check_replay(root, [0, 1], by_step, steps)


def test_fault_tolerance_refuses_bad_arguments():
    with pytest.raises(ValueError, match="replica_id"):
        fs.FaultTolerance(replica_id="")
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):
        fs.FaultTolerance(min_replicas=0)
    with pytest.raises(ValueError, match="timeout"):
        fs.FaultTolerance(timeout=0)
    with pytest.raises(ValueError, match="lighthouse"):
        fs.FaultTolerance(lighthouse="")


def _init_with(outer: str, ft: fs.FaultTolerance, model_device: str = "cpu") -> str:
    from helpers_errors import error_text

    with torch.device(model_device):
        model = models.make_model(seed=0)
    return error_text(
        lambda: fs.init(
            model,
            fs.optim.sgd(0.1),
            mesh=fs.make_mesh(device_type="cpu"),
            outer_strategy=outer,
            fault_tolerance=ft,
        )
    )


def test_init_refuses_what_fault_tolerance_cannot_do(pool2, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    ft = fs.FaultTolerance(replica_id="0")
    outer, meta, nowhere = pool2.run(_refusals, ft)[0]
    assert "ValueError" in outer and "outer_strategy='no_shard'" in outer, outer
    assert "ValueError" in meta and "meta device" in meta, meta
    if HAVE_TORCHFT:
        assert "ValueError" in nowhere and "TORCHFT_LIGHTHOUSE" in nowhere, nowhere


def _refusals(ft: fs.FaultTolerance) -> tuple[str, str, str]:
    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    return (
        _init_on_2x1("optim", ft),
        _init_with("no_shard", ft, model_device="meta"),
        _init_with("no_shard", ft),
    )


def _init_on_2x1(outer: str, ft: fs.FaultTolerance) -> str:
    from helpers_errors import error_text

    model = models.make_model(seed=0)
    return error_text(
        lambda: fs.init(
            model,
            fs.optim.sgd(0.1),
            mesh=fs.make_mesh(shard=1, replicate=2, device_type="cpu"),
            strategy="optim",
            outer_strategy=outer,
            fault_tolerance=ft,
        )
    )


def test_missing_torchft_says_how_to_install(monkeypatch):
    from funcshard.fault import replicas as fault

    monkeypatch.setitem(sys.modules, "torchft", None)
    monkeypatch.setitem(sys.modules, "torchft.manager", None)
    with pytest.raises(ImportError, match=r'pip install "funcshard\[ft\]"'):
        fault.Replicas(fs.FaultTolerance(lighthouse="http://127.0.0.1:1"), torch.device("cpu"))


def _init_alone(address: str) -> str | None:
    """One group's fs.init at a lighthouse that waits for two: the error it raises."""
    from helpers_errors import error_text

    model = models.make_model(seed=0)
    ft = fs.FaultTolerance(replica_id="0", lighthouse=address, timeout=1.0)
    mesh = fs.make_mesh(device_type="cpu")
    return error_text(lambda: fs.init(model, fs.optim.sgd(0.1), mesh=mesh, fault_tolerance=ft))


def _heartbeats_end(log: str, after: int) -> None:
    """Waits until the lighthouse's log, past its first ``after`` bytes, reports that no
    manager heartbeats any more (a leaked manager heartbeats forever)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        with open(log) as f:
            if "[0 heartbeating]" in f.read()[after:]:
                return
        time.sleep(0.2)
    pytest.fail(f"the failed fs.init's manager still heartbeats at the lighthouse:\n{log}")


@needs_torchft
def test_an_init_without_quorum_raises_a_timeout_and_a_retry_does_not_meet_itself(
    pool1, tmp_path, lighthouse
):
    # a group of one rank: what is under test is the group's manager at the lighthouse
    lh = lighthouse(min_replicas=2)
    log = str(tmp_path / "lighthouse.log")
    for attempt in range(2):
        for error in pool1.run(_init_alone, lh.address):
            assert error is not None, f"attempt {attempt}: fs.init formed a quorum alone"
            assert error.startswith("TimeoutError: fs.init: replica group '0' formed no quorum")
            assert f"at the lighthouse {lh.address}" in error, error
        if attempt == 0:  # the failed call's manager stops; its request lapses at the lighthouse
            _heartbeats_end(log, after=os.path.getsize(log))

"""Live fault tolerance (fs.FaultTolerance, torchft) under failures: 2 replica groups x 2 gloo
ranks, the small MLP of the tests, a lighthouse with a 1 s heartbeat timeout.

    python experiments/bench_ft.py --steps=60 --kill_every=15 --step_sleep=0.1

Run 1: no failure. Run 2: group 1 SIGKILLs itself mid-step (after the quorum, before the
cross-group all-reduce) every --kill_every of its steps and is restarted at once; group 0
survives. Printed: committed steps per minute of the survivor in each run, the survivor's
stall per failure (the wall time of its broken step plus the next one, less two normal
steps), and the restarted group's time in fs.init (heal included) and its process start.
A restart with torchrun (tests/test_kill_restart.py, tests/test_nodes.py) loses the whole
job's restart plus the replayed steps (docs/benchmarks.md has both figures), beside which the
stall here is what survives of a failure.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

import _ft_job  # noqa: E402

from funcshard.distributed.launch import free_port  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 60, "Committed steps per run.", lower_bound=4)
flags.DEFINE_integer("kill_every", 15, "Group 1 is killed every this many steps.", lower_bound=2)
flags.DEFINE_float("step_sleep", 0.1, "Seconds each step sleeps (a longer step).", lower_bound=0)


def _lighthouse(root: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    cmd = [binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"]
    cmd += ["--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "1000"]
    log = open(os.path.join(root, "lighthouse.log"), "w")  # noqa: SIM115 - the process's
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _records(root: str, group: int) -> list[dict]:
    with open(os.path.join(root, f"g{group}", "rank0.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run(root: str, failures: bool) -> dict:
    os.environ["FT_JOB_STEP_SLEEP"] = str(FLAGS.step_sleep)
    lh, address = _lighthouse(root)
    try:
        survivor = _ft_job.start_group(root, 0, FLAGS.steps, address)
        kill = FLAGS.kill_every if failures else None
        victim = _ft_job.start_group(root, 1, FLAGS.steps, address, kill_at=kill)
        starts = []
        while failures and all(p.poll() is None for p in survivor):
            if all(p.poll() is not None for p in victim):
                step = max(r["step"] for r in _records(root, 0) if r["kind"] == "step")
                nxt = step + FLAGS.kill_every
                kill = nxt if nxt < FLAGS.steps - 2 else None
                starts.append(time.time())
                victim = _ft_job.start_group(root, 1, FLAGS.steps, address, kill_at=kill)
            time.sleep(0.05)
        for p in survivor + victim:
            p.wait(timeout=600)
    finally:
        lh.kill()
        lh.wait()
    return _summary(root, starts)


def _summary(root: str, starts: list[float]) -> dict:
    steps = [r for r in _records(root, 0) if r["kind"] == "step"]
    committed = [r for r in steps if r["committed"]]
    wall = steps[-1]["t"] - steps[0]["t"] + steps[0]["s"]
    normal = statistics.median(r["s"] for r in steps)
    stalls = []
    for i, r in enumerate(steps):
        if not r["committed"] and i + 1 < len(steps):
            stalls.append(r["s"] + steps[i + 1]["s"] - 2 * normal)
    inits = [r for r in _records(root, 1) if r["kind"] == "init"][1:]
    return {
        "committed_per_min": 60 * len(committed) / wall,
        "failures": len(stalls),
        "stall_s": stalls,
        "step_s": normal,
        "heal_init_s": [r["s"] for r in inits],
        "restart_to_healed_s": [r["t"] - t for r, t in zip(inits, starts, strict=False)],
        "healed_at_step": [r["step"] for r in inits],
    }


def main(argv: list[str]) -> None:
    del argv
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        base, failing = _run(a, failures=False), _run(b, failures=True)
    print(json.dumps({"no_failure": base, "failures": failing}, indent=1))
    print(
        f"committed steps/min: {base['committed_per_min']:.0f} without failures, "
        f"{failing['committed_per_min']:.0f} with {failing['failures']} failures; survivor "
        f"stall per failure {', '.join(f'{s:.2f}' for s in failing['stall_s'])} s; "
        f"fs.init of the restarted group (heal included) "
        f"{', '.join(f'{s:.2f}' for s in failing['heal_init_s'])} s"
    )


if __name__ == "__main__":
    app.run(main)

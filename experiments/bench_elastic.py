"""What an elastic run pays to lose a node and to take it back, phase by phase.

    sudo python experiments/bench_elastic.py       # torch's rendezvous defaults
    sudo python experiments/bench_elastic.py --keep_alive_interval=1 \\
        --keep_alive_max_attempt=5 --last_call_timeout=1          # the fast settings
    sudo python experiments/bench_elastic.py --loss=cut --collective_timeout=10   # B cut off

Two network-namespace nodes (experiments/nodes.py) x ``--nproc_per_node`` ranks run
experiments/train.py by docs/multi-node.md's recipe: ``torchrun --nnodes=1:2 --max-restarts=3
--rdzv-backend=c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ``--grad_chunks=4
--deterministic --resume`` and a checkpoint every ``--save_every`` steps. Once step
``--kill_at`` is logged, node B is killed (SIGKILL to every process in it: its peers' sockets
get a reset at once), or with ``--loss=cut`` its link goes down (its peers hear nothing and
wait for ``--collective_timeout``; B's processes are killed unheard once A has resumed, and
the link comes back up); once node A has
done ``--rejoin_after`` steps alone, B's torchrun starts again. The times come from node A's
torchrun log (``LOGLEVEL=INFO``: a worker failed, a round formed, new nodes detected) and from
metrics.jsonl (each start's process start, join and restore time; each step's time). Printed:
each phase of the loss and of the rejoin, the steps replayed, and the total, from the kill
(or B's start) until the run is back at the step it had reached.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `experiments` as a package
from experiments.nodes import Nodes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
flags.DEFINE_integer("nproc_per_node", 2, "Ranks per node.", lower_bound=1)
flags.DEFINE_integer("steps", 150, "Steps of the run.", lower_bound=1)
flags.DEFINE_integer("save_every", 10, "Checkpoint interval (steps).", lower_bound=1)
flags.DEFINE_integer("kill_at", 25, "Kill node B once this step is logged.", lower_bound=1)
flags.DEFINE_integer("rejoin_after", 15, "Start B again after A's steps alone.", lower_bound=1)
flags.DEFINE_enum(
    "loss",
    "kill",
    ["kill", "cut"],
    "kill: every process of B dies (their peers get a reset at once); cut: B's link goes "
    "down (a silent loss: A's collectives wait --collective_timeout), B is killed once A "
    "has resumed, then its link comes back.",
)
flags.DEFINE_float("collective_timeout", 30.0, "train.py --collective_timeout (seconds).")
flags.DEFINE_integer("keep_alive_interval", None, "rdzv-conf (torch's default 5 s).")
flags.DEFINE_integer("keep_alive_max_attempt", None, "rdzv-conf (torch's default 3).")
flags.DEFINE_integer("last_call_timeout", None, "rdzv-conf (torch's default 30 s).")
flags.DEFINE_float("monitor_interval", 0.2, "torchrun --monitor-interval (its default 0.1 s).")
flags.DEFINE_string("rate", None, "Each node's link rate per direction (tc syntax).")
flags.DEFINE_list("train_args", [], "More experiments/train.py flags (--d_model=128,...).")
flags.DEFINE_float("timeout", 600.0, "Seconds before everything is stopped.")

_AGENT = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) +\d+ \S*torch/distributed/\S+\] (.*)$")


def _agent_events(log: str) -> list[tuple[float, str]]:
    """(Unix time, message) of every line torchrun's agent wrote to ``log``."""
    year = datetime.date.today().year
    events = []
    for line in Path(log).read_text(errors="replace").splitlines():
        m = _AGENT.match(line)
        if m:
            when = datetime.datetime.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S.%f")
            events.append((when.timestamp(), m[3]))
    return events


def _first(events: list[tuple[float, str]], text: str, after: float) -> float:
    return next(t for t, msg in events if t >= after and text in msg)


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Seen:
    """Every step row metrics.jsonl ever held (a resumed round drops the rows it replays)."""

    def __init__(self, path: Path) -> None:
        self.path, self.steps, self._stop = path, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            try:
                rows = _rows(self.path)
            except (json.JSONDecodeError, OSError):  # read while rank 0 rewrote it
                continue
            for r in rows:
                if "step" in r:
                    self.steps.setdefault((r["step"], r["world"], r["time"]), r)

    def reached(self, t: float) -> int:
        """The highest step logged by ``t``."""
        return max((step for step, _, when in list(self.steps) if when <= t), default=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _wait(predicate, run, what: str) -> None:
    deadline = time.monotonic() + FLAGS.timeout
    while not predicate():
        if time.monotonic() > deadline or any(c not in (None, 0) for c in run.poll()[:1]):
            run.stop()
            sys.exit(f"bench_elastic: no {what}\n{run.tails()}")
        time.sleep(0.02)


def _report(title: str, t0: float, phases: list[tuple[str, float]]) -> None:
    print(f"\n{title}")
    last = t0
    for label, t in phases:
        print(f"  {label:<58} {t - last:6.2f} s")
        last = t
    print(f"  {'total':<58} {last - t0:6.2f} s")


def _round_phases(steps: list[dict], reached: int, start: dict) -> list[tuple[str, float]]:
    """The round that ``start`` began: its workers' start, join, first step, and the step that
    brings it back to ``reached``."""
    after = [r for r in steps if r["time"] > start["time"]]
    if not after:
        sys.exit(f"bench_elastic: the round resumed at {start['start']} did no step: more --steps")
    back = next(r for r in after if r["step"] >= reached)
    return [
        ("the workers start", start["time"]),
        ("joined: imports, fs.init_from_env", start["joined"]),
        (f"first step done: build, restore ({start['restore_s']:.2f} s), step", after[0]["time"]),
        (f"back at step {reached}: {reached - start['start']} steps replayed", back["time"]),
    ]


def main(argv: list[str]) -> None:
    del argv
    conf = {
        k: FLAGS[k].value
        for k in ("keep_alive_interval", "keep_alive_max_attempt", "last_call_timeout")
        if FLAGS[k].value is not None
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # else torch 2.13 cannot take a node back
        "LOGLEVEL": "INFO",  # the agent's events, with their times
    }
    load = [os.getloadavg()[0]]
    with (
        tempfile.TemporaryDirectory(prefix="bench_elastic-") as tmp,
        Nodes(2, rate=FLAGS.rate) as net,
    ):
        out = Path(tmp) / "out"
        argv = [
            str(ROOT / "experiments" / "train.py"),
            f"--steps={FLAGS.steps}",
            f"--save_every={FLAGS.save_every}",
            "--grad_chunks=4",
            "--deterministic",
            "--param_dtype=fp32",
            "--threads=1",
            "--device=cpu",
            "--resume",
            f"--collective_timeout={FLAGS.collective_timeout}",
            f"--out_dir={out}",
            f"--checkpoint_dir={Path(tmp) / 'ckpt'}",
            *FLAGS.train_args,
        ]
        kw = dict(
            nnodes="1:2",
            nproc_per_node=FLAGS.nproc_per_node,
            torchrun_args=["--max-restarts=3", f"--monitor-interval={FLAGS.monitor_interval}"],
            rdzv_conf=conf,
            env=env,
            log_dir=tmp,
        )
        metrics = out / "metrics.jsonl"
        seen = _Seen(metrics)
        steps = lambda: [r for r in seen.steps.values()]  # noqa: E731
        starts = lambda: [r for r in _rows(metrics) if "start" in r]  # noqa: E731
        run = net.torchrun(argv, **kw)
        _wait(lambda: any(r["step"] >= FLAGS.kill_at for r in steps()), run, "kill step")
        t_kill = time.time()
        if FLAGS.loss == "kill":
            net.kill(1)
        else:
            net.set_link(1, up=False)
        _wait(lambda: len(starts()) >= 2, run, "round after the loss")
        if FLAGS.loss == "cut":  # B's processes end unheard; a new B finds its link back
            net.kill(1)
            net.set_link(1, up=True)
        resumed = starts()[1]["start"]
        _wait(
            lambda: any(r["step"] >= resumed + FLAGS.rejoin_after for r in steps()),
            run,
            "steps on the smaller world",
        )
        t_back = time.time()
        back = net.torchrun(argv, nodes=[1], **kw)
        codes = [run.procs[0].wait(timeout=FLAGS.timeout), back.procs[0].wait(FLAGS.timeout)]
        seen.close()
        load.append(os.getloadavg()[0])
        if any(codes):
            sys.exit(f"bench_elastic: nodes exited {codes}\n{run.tails()}")
        events = _agent_events(run.logs[0])
        rows = _rows(metrics)

    all_steps = [r for r in rows if "step" in r]
    first, lost, joined = [r for r in rows if "start" in r]
    worlds = {first["world"], lost["world"]}
    pace = {w: statistics.median(_step_times(all_steps, w)) for w in worlds}

    t_fail = _first(events, "failed (exitcode", t_kill)
    t_round = _first(events, "Rendezvous complete", t_fail)
    reached = seen.reached(t_kill)
    print(
        f"2 nodes x {FLAGS.nproc_per_node} ranks, G = 4, checkpoint every {FLAGS.save_every} "
        f"steps, rdzv-conf {conf or 'torch defaults'}, collective timeout "
        f"{FLAGS.collective_timeout:g} s, load {load[0]:.1f} -> {load[1]:.1f}; "
        f"step {pace[first['world']]:.3f} s on {first['world']} ranks, "
        f"{pace[lost['world']]:.3f} s on {lost['world']}"
    )
    _report(
        f"node B {'killed' if FLAGS.loss == 'kill' else 'cut off'} at step {reached}: "
        f"node A resumes at checkpoint {lost['start']} "
        f"on {lost['world']} ranks",
        t_kill,
        [
            (
                "A's ranks fail (a collective finds B gone), agent sees it"
                if FLAGS.loss == "kill"
                else "A's ranks fail (a collective times out), agent sees it",
                t_fail,
            ),
            ("a round of 1 node forms (B's heartbeats expire, last call)", t_round),
            *_round_phases(all_steps, reached, lost),
        ],
    )
    t_seen = _first(events, "new nodes", t_back)
    t_round2 = _first(events, "Rendezvous complete", t_seen)
    reached2 = seen.reached(t_seen)
    _report(
        f"node B back (torchrun started at step {seen.reached(t_back)}): "
        f"{joined['world']} ranks resume at checkpoint {joined['start']}",
        t_back,
        [
            ("A's agent sees B waiting (B's torchrun starts, joins)", t_seen),
            ("a round of 2 nodes forms (A's ranks stopped)", t_round2),
            *_round_phases(all_steps, reached2, joined),
        ],
    )


def _step_times(steps: list[dict], world: int) -> list[float]:
    """Seconds between consecutive steps of one round on ``world`` ranks."""
    return [
        b["time"] - a["time"]
        for a, b in zip(steps, steps[1:], strict=False)
        if a["world"] == b["world"] == world and b["step"] == a["step"] + 1
    ] or [float("nan")]


if __name__ == "__main__":
    app.run(main)

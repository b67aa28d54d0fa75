"""Several "nodes" on one machine: Linux network namespaces joined by shaped veth links.

Each node is a network namespace with ``lo`` and one interface ``eth0`` (an address in
10.213.0.0/24, which exists only inside the namespaces made here). Every ``eth0`` is one end
of a veth pair whose other end is a port of a bridge in a separate "switch" namespace, so the
root namespace's network is never touched. Each link is shaped in both directions with ``tc``
(``tbf`` for a rate; ``netem`` for a delay, where the kernel has it). Needs root and iproute2.

    sudo python experiments/nodes.py --nodes=2 --nproc_per_node=2 --rate=1gbit -- \
        experiments/train.py --steps=20           # torchrun on every node, then link bytes
    sudo python experiments/nodes.py --nodes=2 --rate=100mbit --measure=3   # the achieved rate

From Python (the tests do this)::

    with Nodes(2, rate="1gbit") as nodes:
        run = nodes.torchrun(["job.py", "--flag"], nproc_per_node=2, log_dir=tmp)
        codes = run.wait(timeout=60)
        print(nodes.counters(0))      # bytes that crossed node 0's link

torchrun inside a namespace needs ``--local-addr=<node addr>`` (else the agent advertises the
machine's hostname, which resolves outside the namespace) and, on the rendezvous host,
``--rdzv-conf=is_host=1`` (the host check compares hostnames, which namespaces share); gloo is
bound to ``eth0`` with ``GLOO_SOCKET_IFNAME``. ``Nodes.torchrun`` passes all of them.
Everything made is deleted on exit, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

__all__ = ["IFNAME", "LinkCounters", "Nodes", "NodesRun", "parse_rate", "unavailable"]

IFNAME = "eth0"
SUBNET = "10.213.0"  # private (RFC 1918); only ever inside namespaces made here
_BRIDGE = "br0"
_counter = 0  # several Nodes in one process get distinct names


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _sh(argv: Sequence[str]) -> None:
    """Runs a setup command; raises with its stderr."""
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nodes: `{' '.join(argv)}` failed: {r.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, no netns), or None."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"fsprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$", re.I)
_RATE_SCALE = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate ("100mbit", "1gbit", "50mbps" = megabytes/s).

    >>> parse_rate("100mbit")
    100000000.0
    """
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"nodes: rate {rate!r} is not a tc rate like 100mbit, 1gbit, 50mbps")
    return float(m.group(1)) * _RATE_SCALE[m.group(2).lower()]


@dataclasses.dataclass(frozen=True, slots=True)
class LinkCounters:
    """Byte and packet counters of one node's ``eth0`` (rx: into the node, tx: out of it)."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )


class NodesRun:
    """One command started under torchrun in every node (see ``Nodes.torchrun``)."""

    def __init__(self, procs: list[subprocess.Popen], logs: list[str]) -> None:
        self.procs = procs
        self.logs = logs  # one file per node: torchrun's and its workers' output

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of every node's torchrun, in node order.

        Raises:
          TimeoutError: a node was still running after ``timeout`` seconds (every node is
            stopped first; the message carries the end of each node's log).
        """
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(
                    f"nodes: still running after {timeout:.0f} s\n{self.tails()}"
                ) from None
        return [p.returncode for p in self.procs]

    def stop(self) -> None:
        """SIGTERM to each node's torchrun (it stops its workers), SIGKILL after 5 s."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def tails(self, chars: int = 3000) -> str:
        out = []
        for i, path in enumerate(self.logs):
            with open(path, errors="replace") as f:
                text = f.read()
            out.append(f"--- node {i} ({path}) ---\n{text[-chars:]}")
        return "\n".join(out)


class Nodes:
    """``n`` network-namespace nodes behind one bridge, each link shaped by ``tc``.

    Args:
      n: number of nodes.
      rate: each link's rate in each direction, as ``tc`` writes it ("1gbit"); None: unshaped.
      delay: one-way delay added in each direction ("5ms"); needs ``netem`` in the kernel.
      tag: prefix of the namespaces' names; default unique per process and instance.

    Use as a context manager: entering makes everything, leaving (also on an exception or
    Ctrl-C) stops every process still in the namespaces and deletes them, which deletes the
    veth links and the bridge with them. A SIGTERM to the process does the same (while inside
    ``with``, if nothing else handles SIGTERM), and so does interpreter exit (``atexit``).
    """

    def __init__(
        self, n: int, *, rate: str | None = None, delay: str | None = None, tag: str | None = None
    ) -> None:
        global _counter
        if not 1 <= n <= 250:
            raise ValueError(f"nodes: n must be in 1..250, got {n}")
        if rate is not None:
            parse_rate(rate)
        _counter += 1
        self.n = n
        self.rate = rate
        self.delay = delay
        self.tag = tag or f"fsn{os.getpid()}x{_counter}"
        self.names = [f"{self.tag}n{i}" for i in range(n)]
        self.switch = f"{self.tag}sw"
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # --- making and deleting -------------------------------------------------------------

    def __enter__(self) -> Nodes:
        # A SIGTERM (a test runner's timeout, `kill`) would end Python without unwinding;
        # where nobody handles it yet, it unwinds like Ctrl-C for as long as the nodes exist.
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)

    def up(self) -> None:
        """Makes the namespaces, links and shaping; on any failure deletes what it made."""
        reason = unavailable()
        if reason:
            raise RuntimeError(f"nodes: {reason}")
        atexit.register(self.down)
        try:
            self._netns_add(self.switch)
            _sh(["ip", "-n", self.switch, "link", "add", _BRIDGE, "type", "bridge"])
            _sh(["ip", "-n", self.switch, "link", "set", _BRIDGE, "up"])
            for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
                self._netns_add(ns)
                port = f"p{i}"
                _sh(["ip", "link", "add", port, "netns", self.switch, "type", "veth",
                     "peer", "name", IFNAME, "netns", ns])  # fmt: skip
                _sh(["ip", "-n", self.switch, "link", "set", port, "master", _BRIDGE, "up"])
                _sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME])
                _sh(["ip", "-n", ns, "link", "set", IFNAME, "up"])
                self._shape(ns, IFNAME)  # out of the node
                self._shape(self.switch, port)  # into the node
        except BaseException:
            self.down()
            raise

    def _netns_add(self, ns: str) -> None:
        _sh(["ip", "netns", "add", ns])
        self._made.append(ns)
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _shape(self, ns: str, dev: str) -> None:
        if self.delay is not None:
            netem = ["netem", "delay", self.delay, "limit", "100000"]
            if self.rate is not None:
                netem += ["rate", self.rate]
            r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *netem],
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode != 0:
                raise RuntimeError(
                    f"nodes: --delay needs tc's netem, which failed here ({r.stderr.strip()}); "
                    "this kernel may lack CONFIG_NET_SCH_NETEM. --rate alone uses tbf."
                )
        elif self.rate is not None:
            # burst: at least one 64 KiB GSO segment (veth hands tbf whole GSO packets) and
            # 4 ms of traffic; the queue holds 100 ms before tbf drops.
            burst = max(65536, int(parse_rate(self.rate) / 8 * 0.004))
            _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                 "burst", str(burst), "latency", "100ms"])  # fmt: skip

    def down(self) -> None:
        """Stops every process left in the namespaces and deletes them (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for ns in reversed(self._made):
            self._kill_inside(ns)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=1.0)
        self._procs.clear()

    @staticmethod
    def _kill_inside(ns: str) -> None:
        """SIGTERM, then SIGKILL, to every process in ``ns`` (only ours: we made it)."""
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
            pids = _pids(ns)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = _pids(ns)
            if not pids:
                return

    # --- using them ----------------------------------------------------------------------

    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node], *argv]

    def popen(
        self,
        node: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        stdout: IO | int | None = None,
    ) -> subprocess.Popen:
        """Starts ``argv`` in node ``node`` (its own process group), stopped by ``down``."""
        p = subprocess.Popen(
            self.exec_argv(node, argv),
            env=dict(os.environ if env is None else env),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=True,
        )
        self._procs.append(p)
        return p

    def kill(self, node: int) -> None:
        """Every process in node ``node`` dies at once (SIGKILL): a lost node."""
        for pid in _pids(self.names[node]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def set_link(self, node: int, up: bool) -> None:
        """Node ``node``'s ``eth0`` down (a cable pulled: its processes live on, nothing
        reaches them and nothing of theirs gets out, not even a reset) or up again."""
        _sh(["ip", "-n", self.names[node], "link", "set", IFNAME, "up" if up else "down"])

    def counters(self, node: int) -> LinkCounters:
        """The counters of node ``node``'s ``eth0`` (``ip -s -j link`` in its namespace)."""
        r = _ip("-j", "-s", "-n", self.names[node], "link", "show", "dev", IFNAME)
        stats = json.loads(r.stdout)[0]["stats64"]
        return LinkCounters(
            stats["rx"]["bytes"], stats["tx"]["bytes"], stats["rx"]["packets"],
            stats["tx"]["packets"],
        )  # fmt: skip

    def torchrun(
        self,
        argv: Sequence[str],
        *,
        nproc_per_node: int = 1,
        nnodes: str | None = None,
        port: int = 29400,
        nodes: Sequence[int] | None = None,
        torchrun_args: Sequence[str] = (),
        rdzv_conf: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        log_dir: str | None = None,
    ) -> NodesRun:
        """Starts ``python -m torch.distributed.run ... argv`` in each of ``nodes`` (all).

        Rendezvous: c10d at node 0's address:``port`` (node 0 is its host), ``--rdzv-id`` this
        instance's tag, ``--local-addr`` each node's address, gloo on ``eth0``.

        Args:
          argv: the script and its arguments, as after ``torchrun``'s own.
          nproc_per_node: ranks per node.
          nnodes: torchrun's ``--nnodes`` ("2", or "1:2" for elastic); default all nodes.
          port: the rendezvous port on node 0.
          nodes: which nodes to start it in (a node started later can join an elastic run).
          torchrun_args: more torchrun flags (``--max-restarts=3``), not ``--rdzv-conf``.
          rdzv_conf: more ``--rdzv-conf`` entries ({"last_call_timeout": 1}).
          env: the environment (default ``os.environ``); GLOO_SOCKET_IFNAME is added.
          log_dir: where each node's log ``node<i>.log`` goes; default a new temporary one.
        """
        log_dir = log_dir or tempfile.mkdtemp(prefix=f"{self.tag}-")
        env = {**(os.environ if env is None else env), "GLOO_SOCKET_IFNAME": IFNAME}
        procs, logs = [], []
        for i in range(self.n) if nodes is None else nodes:
            conf = ",".join(
                f"{k}={v}" for k, v in {"is_host": int(i == 0), **(rdzv_conf or {})}.items()
            )
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={nnodes or self.n}", f"--node-rank={i}",
                f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.addrs[0]}:{port}",
                f"--rdzv-id={self.tag}", f"--rdzv-conf={conf}",
                f"--local-addr={self.addrs[i]}", *torchrun_args, *argv,
            ]  # fmt: skip
            logs.append(os.path.join(log_dir, f"node{i}.log"))
            with open(logs[-1], "ab") as log:
                procs.append(self.popen(i, cmd, env=env, stdout=log))
        return NodesRun(procs, logs)

    def measure(self, seconds: float, src: int = 0, dst: int = 1) -> float:
        """Bits per second that crossed ``src``'s link while it sent TCP to ``dst``.

        A Python sender and receiver (no extra tools) run inside the two namespaces; the rate
        is the sender's ``tx_bytes`` (headers included) over the sending time.
        """
        port = "29399"
        recv = (
            "import socket\ns=socket.socket()\n"
            "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{self.addrs[dst]}',{port}));s.listen(1);print('ready',flush=True)\n"
            "c,_=s.accept()\nwhile c.recv(1<<20): pass\n"
        )
        send = (
            "import socket,sys,time\n"
            f"c=socket.create_connection(('{self.addrs[dst]}',{port}));b=b'x'*(1<<20)\n"
            f"t=time.monotonic()\nwhile time.monotonic()-t<{seconds}: c.sendall(b)\nc.close()\n"
        )
        r = self.popen(dst, [sys.executable, "-c", recv], stdout=subprocess.PIPE)
        assert r.stdout is not None
        r.stdout.readline()  # "ready"
        before = self.counters(src)
        t0 = time.monotonic()
        subprocess.run(self.exec_argv(src, [sys.executable, "-c", send]), check=True)
        elapsed = time.monotonic() - t0
        sent = (self.counters(src) - before).tx_bytes
        r.wait(timeout=30)
        return sent * 8 / elapsed


def _pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else []


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so ``with Nodes(...)`` cleans up."""
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str]) -> None:
    from absl import flags

    f = flags.FLAGS
    with _sigterm_raises(), Nodes(f.nodes, rate=f.rate, delay=f.delay) as nodes:
        print(
            f"nodes: {' '.join(f'{n}={a}' for n, a in zip(nodes.names, nodes.addrs, strict=True))}"
        )
        if f.measure:
            print(f"nodes: {nodes.measure(f.measure) / 1e6:.1f} Mbit/s from node 0 to node 1")
        if len(argv) > 1:
            run = nodes.torchrun(
                argv[1:],
                nproc_per_node=f.nproc_per_node,
                torchrun_args=f.torchrun_args,
                log_dir=f.node_logs,
            )
            try:
                codes = run.wait(timeout=f.timeout)
            finally:
                print(run.tails(chars=20000))
            for i in range(nodes.n):
                print(f"nodes: node {i} exit {codes[i]} link {nodes.counters(i)}")
            if any(codes):
                sys.exit(1)


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_integer("nodes", 2, "Number of nodes (network namespaces).", lower_bound=1)
    flags.DEFINE_integer("nproc_per_node", 1, "Ranks per node.", lower_bound=1)
    flags.DEFINE_string("rate", None, "Each link's rate per direction (tc syntax: 1gbit).")
    flags.DEFINE_string("delay", None, "One-way delay per direction (needs netem: 5ms).")
    flags.DEFINE_float("measure", 0.0, "Seconds of TCP from node 0 to 1 to measure the rate.")
    flags.DEFINE_list("torchrun_args", [], "More torchrun flags (--max-restarts=3,...).")
    flags.DEFINE_string("node_logs", None, "Where node<i>.log go (default: a temporary dir).")
    flags.DEFINE_float("timeout", 600.0, "Seconds before every node is stopped.")
    app.run(main)

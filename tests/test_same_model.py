"""fs.init on ranks that built different models: every rank raises, naming the parameter and
the rank (``funcshard.layout.same_model``), instead of a step that pairs one rank's rows of a
weight with another's rows of another weight."""

from __future__ import annotations

import faulthandler
import functools
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard.layout.same_model import difference, spec_of


def init_worker(differs: str) -> str:
    """Rank 2's model (or a setting) differs as ``differs`` says: "transposed" keeps every
    bucket's size (no collective's size would tell), "extra" adds a parameter; other units,
    policy or offload fraction pack other buckets (gloo aborted: "collective mismatch");
    "mesh": rank 2 passes a mesh of 3 replicas, made on every rank (before, every rank
    initialized and the first step's gathers waited on other groups); "compile": rank 2
    alone captures its step (aot_eager), "overlap": rank 2 alone turns inductor's overlap
    passes off (before, every rank initialized and the first step's collectives waited);
    "lambda": rank 2 alone gives another backend by a lambda of the same name."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    odd = rank == 2
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    strategy, kw = "optim_grads_params", {}
    if odd and differs == "transposed":
        model[0] = nn.Linear(4, 6)  # 24 + 6 against 24 + 4: the first is transposed
        model[0].bias = nn.Parameter(torch.zeros(4))
    if odd and differs == "extra":
        model.append(nn.Linear(3, 3))
    if odd and differs == "strategy":
        strategy = "optim_grads"
    if odd and differs == "units":
        kw["units"] = ["1"]
    if odd and differs == "policy":
        kw["policy"] = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if odd and differs == "offload":
        kw["offload_fraction"] = 1.0
    if differs == "compile":
        kw["compile"] = "aot_eager" if odd else False
    if differs == "overlap":
        kw.update(compile="inductor", overlap=not odd)
    if differs == "lambda":  # one qualified name ("<lambda>"), two backends
        kw["compile"] = _backend_lambdas()[odd]
    mesh = fs.make_mesh(device_type="cpu")
    if differs == "mesh":
        replicas = fs.make_mesh(replicate=3, device_type="cpu")  # a collective: every rank
        mesh = replicas if odd else mesh
    try:
        fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy, **kw)
    except ValueError as error:
        return str(error)
    return "initialized"


def _backend_lambdas() -> tuple:
    lookup = torch._dynamo.lookup_backend
    return (
        lambda gm, inputs: lookup("aot_eager")(gm, inputs),
        lambda gm, inputs: lookup("eager")(gm, inputs),
    )


def test_ranks_with_other_models_raise_on_every_rank(pool3) -> None:
    for differs, want in (
        ("transposed", "parameter '0.weight' is (6, 4) float32 on rank 2 of the mesh and (4, 6)"),
        ("extra", "parameter '2.bias' is (3,) float32 on rank 2 of the mesh and absent on rank 0"),
        ("strategy", "rank 2 of the mesh asked for strategy 'optim_grads', rank 0 for"),
        ("units", "rank 2 of the mesh asked for units ('', '1'), rank 0 for ('',)"),
        ("policy", "rank 2 of the mesh asked for policy MixedPrecisionPolicy(param_dtype=torch.b"),
        ("offload", "rank 2 of the mesh asked for offload_fraction 1.0, rank 0 for 0.0"),
        ("mesh", "rank 2 of the mesh gave a mesh of replicate=3 x shard=1, rank 0 of replicate=1"),
        ("compile", "rank 2 of the mesh asked for compile 'aot_eager', rank 0 for None"),
        ("overlap", "rank 2 of the mesh asked for overlap False, rank 0 for True"),
        ("lambda", "_backend_lambdas.<locals>.<lambda> (digest "),
    ):
        got = pool3.run(init_worker, differs)
        assert all(want in text for text in got), (differs, got)
    assert pool3.run(init_worker, "nothing") == ["initialized"] * 3


BAD = {
    "none": {},
    "units": {"units": ["nope"]},
    "offload": {"offload_fraction": 3.0},
    "overlap": {"compile": "aot_eager", "overlap": "no"},  # before: truthy, the passes on
}


def bad_input_worker(bad: str, tensor: int = 1) -> tuple[str, float]:
    """Rank 1 alone given a bad input (``BAD[bad]``): what each rank's fs.init raised, and
    after how many seconds. A rank left waiting dumps its stack and exits after 120 s.
    ``tensor``: the mesh's tensor ranks (2: rank 1's data-parallel peer is rank 3, and ranks
    0 and 2 are told too)."""
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test, not CI
    kw = BAD[bad] if dist.get_rank() == 1 else {}
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    mesh = fs.make_mesh(device_type="cpu", **({"tensor": tensor} if tensor > 1 else {}))
    start = time.monotonic()
    try:
        fs.init(model, fs.optim.sgd(0.1), mesh=mesh, **kw)
        text = "initialized"
    except (ValueError, TypeError) as error:
        text = str(error)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return text, time.monotonic() - start


def test_a_bad_input_on_one_rank_raises_on_every_rank(pool3) -> None:
    """Before, rank 1 raised alone in build_layout and ranks 0 and 2 waited in the same-model
    all-reduce for the process group's timeout (30 minutes)."""
    for bad, own in (
        ("units", "units: no submodule named ['nope'] in Sequential"),
        ("offload", "offload_fraction must lie in [0, 1], got 3.0"),
        ("overlap", "init: overlap must be True or False; got 'no'"),
    ):
        (t0, s0), (t1, s1), (t2, s2) = pool3.run(bad_input_worker, bad)
        kind = "TypeError" if bad == "overlap" else "ValueError"
        assert t1 == own, (bad, t1)
        assert t0 == t2 == f"init failed on rank 1: {kind}: {own}", (bad, t0, t2)
        assert max(s0, s1, s2) < 30, (bad, s0, s1, s2)
    assert [t for t, _ in pool3.run(bad_input_worker, "none")] == ["initialized"] * 3


def test_a_bad_input_on_one_tensor_rank_raises_on_every_rank(pool4) -> None:
    """The agreement spans the world, not only rank 1's data-parallel ranks (1 and 3): its
    tensor peers would wait in their first step's collective."""
    got = pool4.run(bad_input_worker, "units", 2)
    own = "units: no submodule named ['nope'] in Sequential"
    assert got[1][0] == own, got
    assert [t for t, _ in got] == [f"init failed on rank 1: ValueError: {own}", own] + [
        f"init failed on rank 1: ValueError: {own}"
    ] * 2, got
    assert max(s for _, s in got) < 30, got


def other_mesh_worker() -> str:
    """Rank 1 alone passes a mesh with a tensor axis (both meshes made on every rank): what
    each rank's fs.init raised. A rank left waiting dumps its stack and exits after 120 s."""
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test, not CI
    plain, tensor = fs.make_mesh(device_type="cpu"), fs.make_mesh(tensor=2, device_type="cpu")
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    try:
        fs.init(model, fs.optim.sgd(0.1), mesh=tensor if dist.get_rank() == 1 else plain)
        return "initialized"
    except ValueError as error:
        return str(error)
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_a_mesh_of_another_shape_on_one_rank_raises_on_every_rank(pool4) -> None:
    """Before, rank 1 waited in the creation of its data-parallel group (its second
    all-reduce's) and the others in the exchange of their lists, the hashes differing."""
    want = "rank 1 of the mesh gave a mesh of replicate=1 x shard=2 x tensor=2, rank 0 of"
    got = pool4.run(other_mesh_worker)
    assert all(text.startswith(f"init: {want} replicate=1 x shard=4") for text in got), got


def test_difference_names_the_first_parameter_that_differs() -> None:
    a = spec_of({"w": ((2, 3), torch.float32), "b": ((3,), torch.float32)})
    b = spec_of({"w": ((2, 3), torch.bfloat16), "b": ((3,), torch.float32)})
    same = (("strategy", "'no_shard'"),)
    text = difference([(same, a), (same, a), (same, b)])
    assert "'w' is (2, 3) bfloat16 on rank 2 of the mesh and (2, 3) float32 on rank 0" in text


def _compiler_a(gm, example_inputs):  # noqa: ARG001
    return gm


def _compiler_b(gm, example_inputs):  # noqa: ARG001
    return gm.forward


_SET_LAMBDA = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("digest", sys.argv[1])  # stdlib only: no torch
digest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(digest)
print(digest.callable_digest(lambda gm, inputs: gm if inputs in {"alpha", "beta"} else 1.5))
def keyed():  # a table of targets keyed by a function, whose str holds its address
    table = {(lambda x: x): "b"}
    return lambda gm, inputs: table[gm]
print(digest.callable_digest(keyed()))
"""


def test_backend_digests_tell_backends_of_one_name_apart_and_agree_across_processes() -> None:
    """What fs.init's agreement compares of a callable backend: two ``aot_autograd``
    backends (one type, other compilers) or partials of two functions differ, the same one
    built twice, or given another rank, does not; a digest is the same in processes of
    other hash seeds (a set literal's order follows its strings' hashes; a table keyed by a
    function, whose ``str`` holds its address)."""
    from torch._dynamo.backends.common import aot_autograd

    from funcshard.step import digest as digest_module
    from funcshard.step.digest import callable_digest

    a, b = aot_autograd(fw_compiler=_compiler_a), aot_autograd(fw_compiler=_compiler_b)
    assert callable_digest(a) != callable_digest(b)
    assert callable_digest(a) == callable_digest(aot_autograd(fw_compiler=_compiler_a))
    one, two = functools.partial(_compiler_a, 1), functools.partial(_compiler_b, 1)
    assert callable_digest(one) != callable_digest(two)
    # what may differ between ranks running one backend (a rank, a path) does not count
    rank0, rank1 = functools.partial(_compiler_a, rank=0), functools.partial(_compiler_a, rank=1)
    assert callable_digest(rank0) == callable_digest(rank1)
    digests = {
        subprocess.run(
            [sys.executable, "-c", _SET_LAMBDA, digest_module.__file__],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(digests) == 1, digests
    assert [len(line) for line in digests.pop().split()] == [12, 12]


def test_backend_digests_count_held_backend_names_and_read_empty_cells() -> None:
    """A backend holding a backend's name compiles with it: ``CompileCounterWithBackend``
    of "aot_eager" and of "eager" differ (before, equal: both ranks initialized and the
    first step waited until gloo's timeout); a closure over a variable assigned after the
    backend is made (an empty cell) is read, not refused (before, ValueError in fs.init)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from funcshard.step.compiling import compile_settings

    def held(name: str) -> str:
        return compile_settings(CompileCounterWithBackend(name), False)[0][1]

    assert held("aot_eager") != held("eager") and held("eager") == held("eager")

    def backend(gm, example_inputs):  # noqa: ARG001
        return later(gm)

    assert "(digest " in compile_settings(backend, False)[0][1]
    later = torch.compile  # noqa: F841 (assigned after the backend: its cell was empty)


class _PerRankBackend:
    """A backend holding what differs between ranks running it: a table keyed by the rank, a
    module with a hook (hooks are keyed by a process-wide count)."""

    def __init__(self, rank: int, hooks: int) -> None:
        self.by_rank = {rank: f"log_{rank}.txt"}
        self.module = nn.Linear(2, 2)
        for _ in range(hooks):
            self.module.register_forward_hook(lambda *args: None)  # noqa: ARG005

    def __call__(self, gm, example_inputs):  # noqa: ARG002
        return gm


def test_backend_digests_ignore_per_rank_keys() -> None:
    """Plain keys other than a str count by type: a backend keyed by its rank, or holding a
    module whose hook ids differ between processes, is the same backend on every rank."""
    from funcshard.step.digest import callable_digest

    _PerRankBackend(0, 0)  # moves the process-wide hook count
    assert callable_digest(_PerRankBackend(0, 1)) == callable_digest(_PerRankBackend(1, 1))

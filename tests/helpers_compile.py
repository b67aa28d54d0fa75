"""A ``torch.compile`` backend that counts what it compiles, shared by the compile tests."""

from __future__ import annotations

import collections
import operator

import torch

from funcshard.distributed import graph_ops

# where a graph's collectives come from: torch's functional ones, and funcshard's gather in
# place on gloo (funcshard.distributed.graph_ops: the buckets' all-gather on CPU)
COLLECTIVES = ("_c10d_functional", "funcshard")
GATHERS = ("all_gather_into_tensor", "all_gather_sections")


def _from_gather(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes that are a bucket's all-gather's output (one of a function of one graph input:
    not a tensor-parallel activation's) or made of one alone: views, contiguous copies, a
    param wire's decode (casts and arithmetic on the gathered bytes, with constants: tensors
    made of no input)."""
    gathered: set[torch.fx.Node] = set()
    constant: set[torch.fx.Node] = set()
    for node in graph.nodes:  # in topological order
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if getattr(node.target, "_opname", None) in GATHERS:
            if len(_placeholders_above(node)) == 1:  # a bucket's, not an activation's
                gathered.add(node)
        elif all(a in constant for a in inputs):
            constant.add(node)
        elif all(a in gathered or a in constant for a in inputs):
            gathered.add(node)
    return gathered


def _placeholders_above(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The graph inputs ``node`` is computed from."""
    out, seen, todo = set(), {node}, [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a.op == "placeholder":
                out.add(a)
            elif a not in seen:
                seen.add(a)
                todo.append(a)
    return out


def counting_backend(counts: collections.Counter, collectives: collections.Counter | None = None):
    """``aot_eager`` (AOTAutograd, graphs run as traced) counting forward/backward compiles in
    ``counts`` ("forward", "backward"); with ``collectives``, the functional collectives in
    each graph kind (torch's functional ones and funcshard's, :data:`COLLECTIVES`), keyed
    ("forward" or "backward", the op's name: "all_gather_sections", "reduce_scatter_sections",
    "all_to_all_single", "reduce_scatter_tensor", ...), the forward's saved tensors that are
    gathered params ("forward", "saved_gathered") and, in backward, the reduce-scatters
    (funcshard's on gloo, a narrow wire's all-to-alls too) issued before the graph's last
    matmul ("backward", "reduce_scatter_before_last_mm")."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(kind: str, gm: torch.fx.GraphModule) -> None:
        nodes = list(gm.graph.nodes)
        for node in nodes:
            target = node.target
            if getattr(target, "namespace", None) in COLLECTIVES:
                collectives[(kind, target._opname)] += 1
        if kind == "forward":
            outputs = [a for a in nodes[-1].args[0] if isinstance(a, torch.fx.Node)]
            gathered = _from_gather(gm.graph)
            collectives[(kind, "saved_gathered")] += sum(o in gathered for o in outputs)
            return
        mms = [i for i, n in enumerate(nodes) if n.target is torch.ops.aten.mm.default]
        scatters = [
            i
            for i, n in enumerate(nodes)
            if getattr(n.target, "_opname", "")
            in ("reduce_scatter_tensor", "all_to_all_single", "reduce_scatter_sections")
        ]
        collectives[(kind, "reduce_scatter_before_last_mm")] += sum(
            i < max(mms, default=-1) for i in scatters
        )

    def compiler(kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
            counts[kind] += 1
            if collectives is not None:
                record(kind, gm)
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def edges_worker() -> dict:
    """The captured step's edges, one run each (2 ranks, the 2-block MLP, SGD momentum):

    * "reads_model": a loss_fn that reads the model's own ``head.weight`` (a penalty beside
      the model call): eager ZeRO-3, captured ZeRO-3 and captured ZeRO-2, the error each
      raises at the first step (type, message);
    * "penalty": the same penalty read as ``params["head.weight"]``, scaled by a Python float
      that changes every step: captured ZeRO-3 against eager no_shard (the params' largest
      relative difference) and the forward graphs compiled after each step;
    * "wrong_width": the error of a step, in that captured run, on a batch one column too
      wide (type, message): the op's own error, not dynamo's report; the run goes on;
    * "graph_break" and "two_losses": :func:`_graph_break_runs`, :func:`_two_losses_runs`."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import funcshard as fs

    import models

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(device_type="cpu")
    out: dict = {"reads_model": {}}

    def batch(step: int) -> dict:
        return models.local_batch(models.global_batch(step, 8), rank, world)

    for strategy, compile in (
        ("optim_grads_params", False),
        ("optim_grads_params", True),
        ("optim_grads", True),
    ):
        torch._dynamo.reset()
        model = models.make_model(n_blocks=2)
        backend = counting_backend(collections.Counter()) if compile else False
        state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy=strategy, compile=backend)

        def reads_model(params, b, model=model):
            logits = fs.functional_call(model, params, (b["x"],))
            return F.cross_entropy(logits, b["y"]) + 1e-2 * model.head.weight.square().sum()

        try:
            fs.train_step(state, batch(0), reads_model)
            out["reads_model"][(strategy, compile)] = None
        except Exception as e:  # noqa: BLE001
            out["reads_model"][(strategy, compile)] = (type(e).__name__, str(e))

    runs, per_step = {}, []
    for strategy, compile in (("no_shard", False), ("optim_grads_params", True)):
        torch._dynamo.reset()
        counts: collections.Counter = collections.Counter()
        model = models.make_model(n_blocks=2)
        backend = counting_backend(counts) if compile else False
        state = fs.init(
            model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, strategy=strategy, compile=backend
        )
        for step in range(4):
            weight = 0.01 * (step + 1)  # a Python float, new every step

            def penalized(params, b, model=model, weight=weight):
                logits = fs.functional_call(model, params, (b["x"],))
                penalty = params["head.weight"].square().sum()
                return F.cross_entropy(logits, b["y"]) + weight * penalty

            if compile and step == 2:  # an op fails on fake tensors: nothing runs
                wide = {**batch(step), "x": torch.cat([batch(step)["x"]] * 2, dim=1)}
                try:
                    fs.train_step(state, wide, penalized, microbatches=2)
                except Exception as e:  # noqa: BLE001
                    out["wrong_width"] = (type(e).__name__, str(e))
            state, _ = fs.train_step(state, batch(step), penalized, microbatches=2)
            if compile:
                per_step.append(counts["forward"])
        runs[strategy] = fs.full_params(state)
    out["penalty"] = models.max_rel_err(runs["optim_grads_params"], runs["no_shard"])
    out["forward_graphs"] = per_step
    out["graph_break"] = _graph_break_runs(mesh)
    out["two_losses"] = _two_losses_runs(mesh)
    return out if rank == 0 else {}


def eager_reads_worker() -> dict:
    """Captured ZeRO-3 and ZeRO-2 (aot_eager, 2 ranks, the 2-block MLP): a loss_fn whose
    read of the model's own parameter runs eagerly, outside the graphs, per case:

    * "after": a ``torch._dynamo.disable`` helper after the model call reads
      ``model.head.weight`` and adds ``0.5 * w.square().sum()`` (the penalty the attack of
      issue #55 added: it read the initial weights and dropped the penalty's gradient);
    * "before": the same helper called before the model;
    * "tied": the helper reads ``model.extra.weight``, ``head.weight`` tied into a second
      module (one tensor under two names);
    * "traced": a ``print`` (a graph break), then the read in the graph resumed after it;
    * "device": behind the helper, only the parameter's device and ``requires_grad`` (the
      placeholder's are ``meta`` and False: "Cannot copy out of meta tensor" and a count of 0
      trained params before the review's fix).

    Per (strategy, case): the first step's error (type, message, or None), whether the model
    holds its own parameter again after it, and the loss of a plain step run next on the same
    state (the placeholders gone)."""
    import torch.distributed as dist

    import funcshard as fs

    import models

    rank, world = dist.get_rank(), dist.get_world_size()
    batch = models.local_batch(models.global_batch(0, 8), rank, world)
    out = {}
    for strategy in ("optim_grads_params", "optim_grads"):
        for case in ("after", "before", "tied", "traced", "device")[
            : 5 if strategy == "optim_grads_params" else 1
        ]:
            torch._dynamo.reset()
            model = models.make_model(n_blocks=2)
            model.extra = torch.nn.Linear(37, 11, bias=False)
            model.extra.weight = model.head.weight
            state = fs.init(
                model,
                fs.optim.sgd(0.1),
                mesh=fs.make_mesh(device_type="cpu"),
                strategy=strategy,
                compile="aot_eager",
            )
            plain = models.make_loss_fn(model)
            try:
                state, _ = fs.train_step(state, batch, _reading(model, plain, case))
                error = None  # (before: no error, the initial weights read)
            except Exception as e:  # noqa: BLE001
                error = (type(e).__name__, str(e))
            own = type(model.head.weight) is torch.nn.Parameter
            _, metrics = fs.train_step(state, batch, plain)
            out[(strategy, case)] = (error, own, float(metrics["loss"]))
    return out


def _reading(model: torch.nn.Module, plain, case: str):
    """``plain`` plus ``0.5 * w.square().sum()`` of the model's own ``head.weight``, read as
    ``case`` says (:func:`eager_reads_worker`)."""

    @torch._dynamo.disable
    def penalty() -> torch.Tensor:
        w = model.extra.weight if case == "tied" else model.head.weight
        if case == "device":
            return torch.ones((), device=w.device) * w.requires_grad
        return w.square().sum()

    def loss_fn(params, batch):
        if case == "traced":
            print(end="")  # a graph break
            return plain(params, batch) + 0.5 * model.head.weight.square().sum()
        first = penalty() if case == "before" else None
        loss = plain(params, batch)
        return loss + 0.5 * (first if first is not None else penalty())

    return loss_fn


def _two_losses_runs(mesh) -> list[tuple[str, int, int]]:
    """Captured ZeRO-3 (aot_eager), steps with loss A (a print before the model: the step's
    graph holds every gathered param to backward, re-gathers none), then B (no break: each
    bucket re-gathered in backward), then A again (no compile: dynamo runs A's graphs).
    Per step: the loss, fs.comm_stats' all-gather calls and gathered peak."""
    import torch.distributed as dist

    import funcshard as fs

    import models

    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = models.make_model(n_blocks=2)
    state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, compile="aot_eager")
    plain = models.make_loss_fn(model)

    def printing(params, batch):
        print(end="")  # a graph break before the model
        return plain(params, batch)

    out = []
    for step, (name, loss_fn) in enumerate((("A", printing), ("B", plain), ("A", printing))):
        batch = models.local_batch(models.global_batch(step, 8), rank, world)
        with fs.comm_stats() as stats:
            state, _ = fs.train_step(state, batch, loss_fn)
        out.append((name, stats.calls["all_gather"], stats.gathered_peak))
    return out


class _Printing(torch.nn.Module):
    """A block that breaks dynamo's graph: a print in its forward."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.inner = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print(end="")  # a graph break
        return self.inner(x)


def _graph_break_runs(mesh) -> dict:
    """The 3-block MLP whose last block prints (a graph break in the model: the params dict
    is live across it, so the first graph returns every gathered param and re-gathers none;
    the second gathers nothing), 3 steps of
    ZeRO-3 eager and captured: the warnings the captured run gave, the params' largest
    relative difference, the gathered peaks (and in a 4th step of two microbatches of 1 row,
    not 4: its graphs are compiled again) and, captured, the all-gathers ``fs.comm_stats``
    counted in the 3rd step beside those the graphs hold (compiled once, run once)."""
    import warnings

    import funcshard as fs

    import models

    params, peaks, new_shape_peaks = {}, {}, {}
    collectives: collections.Counter = collections.Counter()
    for compile in (False, True):
        torch._dynamo.reset()
        model = models.make_model(n_blocks=3)
        model.blocks[2] = _Printing(model.blocks[2])
        backend = counting_backend(collections.Counter(), collectives) if compile else False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, compile=backend)
            state = models.train(state, model, range(2), rows=8)[0]
            with fs.comm_stats() as stats:
                state = models.train(state, model, range(2, 3), rows=8)[0]
            params[compile], peaks[compile] = fs.full_params(state), stats.gathered_peak
            in_graphs = sum(n for (_, op), n in collectives.items() if op in GATHERS)
            # microbatches of 1 row: each frame's graphs compiled once more (1 row is static
            # for dynamo: one compile a frame; 2 and 1 rows cost a symbolic one too, 13 s)
            with fs.comm_stats() as new_shape:
                models.train(state, model, range(3, 4), rows=4, microbatches=2)
        new_shape_peaks[compile] = new_shape.gathered_peak
    warned = [str(w.message) for w in caught if "graph" in str(w.message)]
    error = models.max_rel_err(params[True], params[False])
    gathers = (stats.calls["all_gather"], in_graphs)
    return {
        "warned": warned,
        "error": error,
        "peaks": peaks,
        "new_shape_peaks": new_shape_peaks,
        "gathers": gathers,
    }


def overlap_worker() -> list:
    """What inductor's config holds inside a captured call's overlap context, per
    ``fs.init(compile=..., overlap=...)``: (reorder_for_compute_comm_overlap, its passes,
    the two unsafe collective swaps of config_comms and the peak-memory budgets of its two
    iterative passes) for
    inductor with overlap on, off and by default, and for aot_eager with it on; then the
    warnings of a captured ZeRO-3 ``fs.init`` per backend. Nothing is compiled."""
    import warnings

    import torch._inductor.config as inductor
    import torch._inductor.config_comms as comms

    import funcshard as fs
    from funcshard.step.compiling import overlap_config

    import models

    out = []
    cases = (("inductor", True), ("inductor", False), ("inductor", None), ("aot_eager", True))
    for backend, overlap in cases:
        state = fs.init(
            models.make_model(n_blocks=2),
            fs.optim.sgd(0.1),
            mesh=fs.make_mesh(device_type="cpu"),
            compile=backend,
            **({} if overlap is None else {"overlap": overlap}),
        )
        with overlap_config(state.layout, state.compile):
            passes = [
                p if isinstance(p, str) else p.__name__
                for p in inductor.reorder_for_compute_comm_overlap_passes
            ]
            unsafe = (
                comms.reorder_iterative_unsafe_collectives_reorder,
                comms.sink_waits_iterative_unsafe_collectives_reorder,
                comms.reorder_iterative_peak_memory_budget,
                comms.sink_iterative_peak_memory_budget,
            )
            out.append((inductor.reorder_for_compute_comm_overlap, passes, unsafe))
    warned = {}
    for backend in ("eager", lambda gm, example: gm.forward, "aot_eager", "inductor"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fs.init(
                models.make_model(n_blocks=2),
                fs.optim.sgd(0.1),
                mesh=fs.make_mesh(device_type="cpu"),
                strategy="optim_grads_params",
                compile=backend,
            )
        name = backend if isinstance(backend, str) else "callable"
        warned[name] = [str(w.message) for w in caught if "AOTAutograd" in str(w.message)]
    return [*out, warned]


def wrapped_worker(steps: int = 3) -> dict:
    """Captured ZeRO-3 (the 2-block MLP, 8 rows over the ranks, 2 microbatches, SGD momentum)
    eagerly and under compile= "aot_eager", "eager" and a plain callable (no
    ``aot_autograd``; it returns ``gm.forward``): per run the params, the losses and
    fs.comm_stats' bytes, calls and gathered peak, and for the callable each graph it got:
    its kind (the backward's holds the reduce-scatters), whether every op is an aten op
    (AOTAutograd's graph, not dynamo's) and the gathered params its forward saves."""
    import funcshard as fs

    import models

    graphs: list = []

    def my_backend(gm: torch.fx.GraphModule, example_inputs):  # noqa: ARG001
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        names = {getattr(n.target, "_opname", "") for n in calls}
        kind = "backward" if "reduce_scatter_sections" in names else "forward"
        ops = [n.target for n in calls if n.target is not operator.getitem]
        aten = all(isinstance(t, torch._ops.OpOverload) for t in ops)
        outputs = [a for a in list(gm.graph.nodes)[-1].args[0] if isinstance(a, torch.fx.Node)]
        saved = sum(o in _from_gather(gm.graph) for o in outputs) if kind == "forward" else 0
        graphs.append((kind, aten, saved))
        return gm.forward

    out: dict = {}
    for name, compile in (
        ("off", False),
        ("aot_eager", "aot_eager"),
        ("eager", "eager"),
        ("callable", my_backend),
    ):
        torch._dynamo.reset()
        model = models.make_model(n_blocks=2)
        state = fs.init(
            model,
            fs.optim.sgd(0.1, momentum=0.9),
            mesh=fs.make_mesh(device_type="cpu"),
            strategy="optim_grads_params",
            compile=compile,
        )
        with fs.comm_stats() as stats:
            state, history = models.train(state, model, range(steps), rows=8, microbatches=2)
        out[name] = {
            "params": fs.full_params(state),
            "losses": [m["loss"] for m in history],
            "bytes": dict(stats.bytes),
            "calls": dict(stats.calls),
            "gathered_peak": stats.gathered_peak,
        }
    out["graphs"] = graphs
    return out


def _reduces_before_last_matmul(prof) -> int:
    """How many of the step's reduces (``funcshard::reduce_scatter_sections_start``) started before
    its last matmul (the backward's): issued as their unit's backward ended, not at the tail."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    mms = [e.time_range.start for e in events if e.name in ("aten::mm", "aten::addmm")]
    reduces = [e for e in events if e.name == "funcshard::reduce_scatter_sections_start"]
    return sum(e.time_range.start < max(mms, default=0) for e in reduces)


def _matmuls_while_reducing(prof) -> list[int]:
    """Per started reduce (in run order), the matmuls the rank ran before its wait: the
    backward the reduce overlapped."""
    return _matmuls_between(prof, "funcshard::reduce_scatter_sections")


def _matmuls_in_flight(prof) -> list[int]:
    """Per started gather (in run order), the matmuls the rank ran before its wait: the
    compute the gather overlapped."""
    return _matmuls_between(prof, "funcshard::all_gather_sections")


def _matmuls_between(prof, op: str) -> list[int]:
    """Per ``{op}_start`` event, in run order, the matmuls before the next ``{op}_wait``."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    counts: list[int] = []
    open_ = False
    for e in events:
        if e.name == f"{op}_start":
            counts.append(0)
            open_ = True
        elif e.name == f"{op}_wait":
            open_ = False
        elif open_ and e.name in ("aten::mm", "aten::addmm"):
            counts[-1] += 1
    return counts


class _InductorGraphs:
    """An inductor post-grad pass recording, per graph it compiles ("forward" or "backward":
    a backward graph takes tangents), its all-gathers and reduce-scatters in order and
    (forward) how many of its outputs, the tensors saved for backward, are gathered params."""

    def __init__(self) -> None:
        import uuid

        from torch._inductor.custom_graph_pass import CustomGraphPass

        self.graphs: list[dict] = []
        self._uuid = uuid.uuid4().hex  # no cached graph skips the pass
        recorder = self

        class Pass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                recorder.record(graph)

            def uuid(self) -> str:
                return recorder._uuid

        self.pass_ = Pass()

    def record(self, graph: torch.fx.Graph) -> None:
        nodes = list(graph.nodes)
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in nodes)
        ops = [
            n.target._opname
            for n in nodes
            if getattr(n.target, "namespace", None) in COLLECTIVES
            and "wait" not in n.target._opname
        ]
        outputs = [a for a in nodes[-1].args[0] if isinstance(a, torch.fx.Node)]
        starts = [
            n for n in nodes if getattr(n.target, "_opname", "") == "reduce_scatter_sections_start"
        ]
        waits = [
            n for n in nodes if getattr(n.target, "_opname", "") == "reduce_scatter_sections_wait"
        ]
        chain = [  # each start's ``after`` the wait of the start before it; the first's
            # the graph's record of its collectives (graph_ops.graph_collectives)
            s.args[1] is w and w.args[0] is p
            if w is not None
            else getattr(s.args[1], "target", None) is graph_ops.GRAPH_COLLECTIVES
            for p, w, s in zip([None, *starts], [None, *waits], starts, strict=False)
        ]
        kinds = ("all_gather_sections_start", "reduce_scatter_sections_start")
        both = [n for n in nodes if getattr(n.target, "_opname", "") in kinds]
        self.graphs.append(
            {
                "kind": "backward" if backward else "forward",
                "collectives": ops,
                # each start after one of the other kind takes that start as its ``other``
                "kinds_tied": [
                    s.kwargs.get("other") is p
                    for p, s in zip(both, both[1:], strict=False)
                    if p.target is not s.target
                ],
                # each reduce start's ``after``: the wait before it (the record for the first)
                "reduce_chain": chain,
                "saved_gathered": 0 if backward else len(_from_gather(graph) & set(outputs)),
            }
        )


def zero2_order_worker(n_blocks: int) -> dict:
    """Captured ZeRO-2 under inductor, overlap on and off, beside eager ZeRO-2 (one model,
    8 rows, 2 steps of SGD momentum): per run, the last step's matmuls and reduces by sends
    in run order (``m``: a matmul, ``R``: a reduce's start or a whole reduce) and the params'
    largest relative difference from eager's."""
    import funcshard as fs

    import models

    out: dict = {}
    for overlap in (None, True, False):  # None: eager
        torch._dynamo.reset()
        model = models.make_model(n_blocks=n_blocks)
        compiled = {"compile": "inductor", "overlap": overlap} if overlap is not None else {}
        state = fs.init(
            model,
            fs.optim.sgd(0.1, momentum=0.9),
            mesh=fs.make_mesh(device_type="cpu"),
            strategy="optim_grads",
            **compiled,
        )
        state = models.train(state, model, [0], rows=8)[0]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            state = models.train(state, model, [1], rows=8)[0]
        events = sorted(prof.events(), key=lambda e: e.time_range.start)
        reduces = ("reduce_scatter_sections_start", "reduce_scatter_sections")
        kinds = {"aten::mm": "m", "aten::addmm": "m", **{f"funcshard::{r}": "R" for r in reduces}}
        out[overlap] = {
            "order": "".join(kinds[e.name] for e in events if e.name in kinds),
            "params": fs.full_params(state),
        }
    for run in (True, False):
        out[run]["err"] = models.max_rel_err(out[run].pop("params"), out[None]["params"])
    return out


def inductor_worker(rows: int, microbatches: int, steps: int) -> dict:
    """Captured ZeRO-3 under inductor by name (overlap by default) beside eager ZeRO-3, from
    one model, ``rows`` global rows a step split over the ranks (uneven when odd: each rank
    compiles its own shapes), ``microbatches``: the params after ``steps`` steps of SGD
    momentum, every step's loss, the collectives of each graph inductor compiled (an
    inductor post-grad pass records them) and, per graph, the lowering indices of its
    collectives in the order the overlap passes left them (a pass appended to theirs), the
    comm_stats bytes and the buckets."""
    from torch._inductor.utils import contains_collective

    from funcshard.step import compiling

    scheduled: list[list[int]] = []

    def record(snodes: list) -> list:
        ops = [s.get_name() for n in snodes for s in n.get_nodes() if contains_collective(s)]
        scheduled.append([int(name.removeprefix("op")) for name in ops])
        return snodes

    overlap = compiling.OVERLAP
    passes = [*overlap["reorder_for_compute_comm_overlap_passes"], record]
    compiling.OVERLAP = {**overlap, "reorder_for_compute_comm_overlap_passes": passes}
    try:
        out = _inductor_runs(rows, microbatches, steps)
    finally:
        compiling.OVERLAP = overlap
    out["scheduled"] = scheduled
    return out


def _inductor_runs(rows: int, microbatches: int, steps: int) -> dict:
    """:func:`inductor_worker`'s two runs."""
    import torch._inductor.config

    import funcshard as fs

    import models

    out: dict = {}
    for compile in (False, "inductor"):
        torch._dynamo.reset()
        model = models.make_model(n_blocks=2)
        state = fs.init(
            model,
            fs.optim.sgd(0.1, momentum=0.9),
            mesh=fs.make_mesh(device_type="cpu"),
            strategy="optim_grads_params",
            compile=compile,
        )
        graphs = _InductorGraphs()
        with (
            torch._inductor.config.patch(post_grad_custom_post_pass=graphs.pass_),
            fs.comm_stats() as stats,
        ):
            state, history = models.train(
                state, model, range(steps - 1), rows=rows, microbatches=microbatches
            )
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                state, last = models.train(  # a step compiled already: what it overlaps
                    state, model, [steps - 1], rows=rows, microbatches=microbatches
                )
            history += last
        out[compile or "eager"] = {
            "overlapped": _matmuls_in_flight(prof),
            "reduced_early": _reduces_before_last_matmul(prof),
            "reduce_overlapped": _matmuls_while_reducing(prof),
            "params": fs.full_params(state),
            "losses": [m["loss"] for m in history],
            "graphs": graphs.graphs,
            "bytes": dict(stats.bytes),
            "buckets": len(state.layout.buckets),
        }
    return out


# issue #55's axes captured (test_compile.test_captured_axes): name -> fs.init's keywords
AXES = {
    # ZeRO-3: the int8 param wire packed, gathered and decoded in the graphs (again in
    # backward), the gradients rounded to bf16 once and summed in fp32 by an all-to-all
    "param_int8_grad_bf16": {
        "policy": {"param_comm_dtype": torch.int8, "grad_comm_dtype": torch.bfloat16}
    },
    # ZeRO-2: the fp8 gradient wire's blockwise encode, all-to-all and decode in the graph
    "zero2_grad_fp8": {
        "policy": {"grad_comm_dtype": torch.float8_e4m3fn},
        "strategy": "optim_grads",
    },
    # HFSDP (1 shard x 2 replicas): the inner shard kept packed on the bf16 param wire,
    # decoded in the graph; the reduce-scatter over "replicate" into the masters after it
    "hfsdp_param_bf16": {
        "policy": {"param_comm_dtype": torch.bfloat16, "grad_comm_dtype": torch.bfloat16},
        "outer_strategy": "optim",
        "mesh": (1, 2),
    },
}


def axes_worker(names: list[str], steps: int = 2) -> dict:
    """Each case of :data:`AXES` (2 ranks, the 2-block MLP, SGD momentum, 2 microbatches),
    eager and captured with the counting backend: per run the full params, fs.comm_stats'
    bytes and calls, the graphs compiled, the collectives in them and fs.init's warnings of
    compile= (rank 0's; {} elsewhere)."""
    import warnings

    import torch.distributed as dist

    import funcshard as fs

    import models

    out: dict = {}
    for name in names:
        kw = dict(AXES[name])
        policy = fs.MixedPrecisionPolicy(**kw.pop("policy", {}))
        shard, replicate = kw.pop("mesh", (2, 1))
        kw.setdefault("strategy", "optim_grads_params")
        for compiled in (False, True):
            torch._dynamo.reset()
            counts, collectives = collections.Counter(), collections.Counter()
            model = models.make_model(n_blocks=2)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = fs.init(
                    model,
                    fs.optim.sgd(0.1, momentum=0.9),
                    mesh=fs.make_mesh(shard, replicate, device_type="cpu"),
                    policy=policy,
                    compile=counting_backend(counts, collectives) if compiled else False,
                    **kw,
                )
            with fs.comm_stats() as stats:
                state = models.train(state, model, range(steps), rows=8, microbatches=2)[0]
            out[(name, compiled)] = {
                "params": fs.full_params(state),
                "bytes": dict(stats.bytes),
                "calls": dict(stats.calls),
                "by_axis": dict(stats.bytes_by_axis),
                "gathered_peak": stats.gathered_peak,
                "counts": dict(counts),
                "collectives": {k: n for k, n in collectives.items() if n},
                "warnings": [str(w.message) for w in caught if "compile=" in str(w.message)],
            }
    out["experts"] = _expert_warnings()
    return out if dist.get_rank() == 0 else {}


def _expert_warnings() -> list[str]:
    """fs.init(compile=...)'s warnings of compile= on an expert-parallel model (helpers_experts'
    MoE, its experts over "expert" = 2), no step run."""
    import warnings

    import funcshard as fs

    import helpers_experts

    mesh = fs.make_mesh(shard=2, expert=2, device_type="cpu")
    model = helpers_experts.place_experts(helpers_experts.make_model(), mesh["expert"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = counting_backend(collections.Counter())
        fs.init(model, fs.optim.sgd(0.1), mesh=mesh, compile=backend)
    return [str(w.message) for w in caught if "compile=" in str(w.message)]

"""What :func:`funcshard.planner.plan.plan` returns: memory per rank (:class:`MemoryPlan`) and
traffic per step (:class:`Plan`), and how they print (``Plan.table``, :func:`format_bytes`)."""

from __future__ import annotations

import dataclasses

__all__ = ["KINDS", "MemoryPlan", "Plan", "PipelinePlan", "format_bytes"]

# how a pipeline plan's bubble weighs its stages, as its table prints it
_STAGES = {"equal": "equal stages", "flops": "stages by FLOPs"}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "metrics", "muon", "buffers")


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes per rank.

    Attributes:
      master: master weight shards on the device.
      compute: compute copies the state keeps (``derive_compute``): ZeRO 0-2 the full compute
        params per bucket (0 where the master itself serves), ZeRO-3 only the device shard of
        offloaded buckets, and under HFSDP the inner shard of every bucket (packed on
        ``param_comm_dtype`` when it is set).
      compute_shard: ZeRO-3, the compute-dtype shards cast from the masters at step time
        (0 where no cast is needed).
      grads: the gradient accumulator during a step: the full unreduced gradient under
        ``no_shard`` / ``optim``, the reduced shard under ``optim_grads`` / ``_params``;
        deterministic with M > 1 microbatches: log2(M) full unreduced partial sums. Under
        ``optim_grads`` / ``_params`` an expert bucket (``expert=E``) also holds its unreduced
        rank sections (``S / E`` times its reduced shard: this expert rank's experts whole)
        from its first gradient to the end of backward, every expert bucket at once.
      opt_state: optimizer state on the device.
      gathered_peak: ZeRO-3, most full (gathered) params alive at once: the root unit plus the
        largest other unit.
      host: offloaded master shards and their optimizer state, in host memory.
      muon_owner: ``fs.optim.muon`` under a sharded strategy, the most whole-matrix bytes
        (bfloat16) one owner holds at once during the step (the busiest rank).
      attention: context parallel (``context=C`` with ``seq_len``, ``batch_size`` and
        ``attention`` given), what every attention call of a microbatch keeps for the backward
        on this rank: q, k, v and the output of its ``L / C`` tokens in the compute dtype and
        the log-sum-exp in fp32 (the ring's node; all_to_all's fused kernel keeps the same on
        the head-split whole sequence). The model's other activations shrink by ``C`` too but
        are the model's own: a plan from shapes does not know them.
      activations: under a pipeline, the stage boundary tensors of the microbatches in flight
        at the schedule's peak on this rank (``PipelinePlan.in_flight`` x one microbatch's
        ``boundary=`` tensor; a stage's own activations are that many microbatches' too).
    """

    master: int
    compute: int
    compute_shard: int
    grads: int
    opt_state: int
    gathered_peak: int
    host: int
    muon_owner: int = 0
    attention: int = 0
    activations: int = 0

    @property
    def state(self) -> int:
        """The TrainState's own buffers: masters, kept compute copies, optimizer state."""
        return self.master + self.compute + self.opt_state + self.host

    @property
    def model_states(self) -> int:
        """The ZeRO paper's "model states": params, gradients and optimizer state (with masters)."""
        return self.state + self.compute_shard + self.grads


@dataclasses.dataclass(frozen=True, slots=True)
class PipelinePlan:
    """The pipeline part of a :class:`~funcshard.planner.report.Plan`.

    Attributes:
      schedule: torch's schedule by name.
      size: pipeline ranks ``P``.
      rank: the pipeline rank the plan's memory and bytes are for.
      stages: the stage indices that rank holds.
      microbatches: microbatches a step.
      bubble: the schedule's bubble fraction over every rank
        (:mod:`funcshard.planner.schedule`), its stages weighted as ``bubble_model`` says.
      bubble_by_rank: each rank's idle fraction of the step.
      in_flight: per rank, the most microbatches whose activations are alive at once.
      boundary_bytes: one microbatch's boundary tensor (0 without ``boundary=``).
      regather: ZeRO-3 gathering per microbatch (``fs.Pipeline(regather=True)``): the
        all-gathers and ``memory.gathered_peak`` are a steady step's, found by running this
        rank's stages on the meta device (:mod:`funcshard.planner.regather`).
      exact: False where a stage could not run there: its gathers are then counted at most
        (every bucket it uses in each phase), ``note`` naming the stage and its error.
      note: why the figures are not exact ("" where they are).
      bubble_model: how ``bubble`` weighs the stages: "equal" (each stage's forward 1, full
        backward 2, input and weight backward 1), or "flops" (each stage's FLOPs, counted by
        running every stage on the meta device on ``inputs=``:
        :mod:`funcshard.planner.stage_cost`). Neither counts the boundary transfers nor the
        optimizer step.
      stage_costs: under "flops", each stage's forward, full backward, input backward and
        weight backward over the mean forward (``StageCost`` of
        :mod:`funcshard.planner.stage_cost`); () under "equal".
      bubble_note: why equal stages stand in though ``inputs=`` was given (a stage that
        does not run on the meta device; "" otherwise).
    """

    schedule: str
    size: int
    rank: int
    stages: tuple[int, ...]
    microbatches: int
    bubble: float
    bubble_by_rank: tuple[float, ...]
    in_flight: tuple[int, ...]
    boundary_bytes: int = 0
    regather: bool = False
    exact: bool = True
    note: str = ""
    bubble_model: str = "equal"
    stage_costs: tuple[tuple[float, float, float, float], ...] = ()
    bubble_note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What one configuration costs per rank (see :func:`plan`)."""

    strategy: str
    world_size: int
    shard: int
    replicate: int
    microbatches: int
    numel: int
    padded_numel: int
    buckets: int
    units: int
    memory: MemoryPlan
    comm: dict[str, int]
    calls: dict[str, int]
    # the same bytes per mesh axis ("shard", "replicate", "world", "tensor"): what crosses the
    # slow link between nodes is the "replicate" entry (see ``fs.comm_stats().bytes_by_axis``)
    comm_by_axis: dict[str, int] = dataclasses.field(default_factory=dict)
    outer_strategy: str = "no_shard"
    tensor: int = 1  # ranks per tensor-parallel group; memory and bytes are tensor rank 0's
    # fs.plan(..., pipeline=P): the schedule's bubble and in-flight microbatches; memory and
    # bytes are then its pipeline rank's (``pipeline.rank``)
    pipeline: PipelinePlan | None = None

    def table(self) -> str:
        """A readable summary."""
        m = self.memory
        rows = [
            (
                f"strategy={self.strategy} outer_strategy={self.outer_strategy} "
                f"world={self.world_size} "
                f"mesh=(replicate={self.replicate}, shard={self.shard}, tensor={self.tensor}) "
                f"microbatches={self.microbatches}"
            ),
            (
                f"params={self.numel:,} padded={self.padded_numel:,} buckets={self.buckets} "
                f"units={self.units}"
            ),
            "memory per rank:",
        ]
        for name in (
            "master",
            "compute",
            "compute_shard",
            "grads",
            "opt_state",
            "gathered_peak",
            "host",
            "muon_owner",
            "attention",
            "activations",
        ):
            rows.append(f"  {name:<14}{format_bytes(getattr(m, name)):>12}")
        rows.append(f"  {'model states':<14}{format_bytes(m.model_states):>12}")
        rows.append("communicated per rank per step:")
        for kind in self.comm:
            rows.append(
                f"  {kind:<14}{format_bytes(self.comm[kind]):>12}  ({self.calls[kind]} calls)"
            )
        rows.append("by mesh axis:")
        for axis, nbytes in self.comm_by_axis.items():
            rows.append(f"  {axis:<14}{format_bytes(nbytes):>12}")
        if self.pipeline is not None:
            pp = self.pipeline
            rows.append(
                f"pipeline: {pp.schedule} P={pp.size} rank={pp.rank} stages={pp.stages} "
                f"microbatches={pp.microbatches} bubble={pp.bubble:.3f} "
                f"({_STAGES[pp.bubble_model]}) in_flight={pp.in_flight}"
            )
            if pp.bubble_note:
                rows.append(f"  bubble of equal stages: {pp.bubble_note}")
            if pp.regather:
                rows.append(
                    "  regather=True: a steady step's gathers (the first step's shape "
                    "inference gathers more)"
                )
            if not pp.exact:
                rows.append(f"  not exact (at most): {pp.note}")
        return "\n".join(rows)


def format_bytes(n: float) -> str:
    """Decimal units (GB = 1e9 bytes), as the ZeRO paper counts."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"

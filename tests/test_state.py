"""funcshard.state.state through its public behaviour: fs.init, the derived compute copies, names.

``fs.init`` shards the model's weights into fp32 master buffers (this rank's rows, as
``fs.shard`` places them); every compute copy is derived from the masters, at init and after
each step; the state is immutable, ``replace`` keeps the old state valid, a donated state
refuses use; ``opt_state_by_name`` keys this rank's optimizer rows by parameter name; the state
is an optree pytree with the same leaf order on every rank.
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs

import models

BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _mesh():
    return fs.make_mesh(device_type="cpu")


def _batch(step: int) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return models.local_batch(models.global_batch(step, 4 * world), rank, world)


def _compute_problems(state) -> list[str]:
    """Where a compute copy is not the master cast to the compute dtype, or should not exist.

    ZeRO 0-2 keep the full compute params: their values are those of ``fs.full_params`` cast
    (compared as sorted values, padding zeros included, whatever the order of the full
    buffer). ZeRO-3 keeps a compute shard only for an offloaded bucket: the master cast.
    """
    layout, problems = state.layout, []
    full = fs.full_params(state)
    for b, master, compute in zip(layout.buckets, state.master, state.compute, strict=True):
        kept = layout.strategy != "optim_grads_params" or b.offload
        if compute is None:
            if kept:
                problems.append(f"bucket {b.index}: no compute copy under {layout.strategy}")
            continue
        if not kept:
            problems.append(f"bucket {b.index}: a ZeRO-3 compute copy beside the master")
        if compute.dtype != b.dtypes.compute:
            problems.append(f"bucket {b.index}: compute dtype {compute.dtype}")
        if layout.strategy == "optim_grads_params":
            derived = torch.equal(compute, master.to(b.dtypes.compute))
        else:
            values = [full[s.name].to(b.dtypes.compute).flatten() for s in layout.bucket_leaves(b)]
            values = torch.cat(values)
            pad = torch.zeros(compute.numel() - values.numel(), dtype=values.dtype)
            derived = torch.equal(compute.sort().values, torch.cat([values, pad]).sort().values)
        if not derived:
            problems.append(f"bucket {b.index}: the compute copy is not derived from the master")
    return problems


def init_worker(strategy: str, offload: float) -> dict:
    mesh, model = _mesh(), models.make_model(seed=2)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, policy=BF16, strategy=strategy,
                    offload_fraction=offload)  # fmt: skip
    expect = fs.shard({n: p.detach() for n, p in model.named_parameters()}, mesh, strategy=strategy)
    out = {
        "names": list(state.params) == [n for n, _ in model.named_parameters()],
        "params": all(torch.equal(state.params[n], expect[n]) for n in expect),
        "master_dtypes": {str(m.dtype) for m in state.master},
        "step": state.step,
        "loss_scale": state.loss_scale,
        "problems_at_init": _compute_problems(state),
    }
    loss_fn = models.make_loss_fn(model)
    for step in range(2):
        state, _ = fs.train_step(state, _batch(step), loss_fn)
    out["moved"] = not all(torch.equal(state.params[n], expect[n]) for n in expect)
    out["problems_after_steps"] = _compute_problems(state)
    out["step_after"] = state.step
    return out


@pytest.mark.parametrize("offload", [0.0, 0.5])
@pytest.mark.parametrize("strategy", fs.STRATEGIES)
def test_init_shards_masters_and_derives_every_compute_copy(pool2, strategy, offload) -> None:
    for r in pool2.run(init_worker, strategy, offload):
        assert r["names"] and r["params"] and r["master_dtypes"] == {"torch.float32"}, r
        assert r["step"] == 0 and r["loss_scale"] is None
        assert r["problems_at_init"] == [] and r["problems_after_steps"] == [], r
        assert r["moved"] and r["step_after"] == 2


def fp16_worker() -> object:
    policy = fs.MixedPrecisionPolicy(param_dtype=torch.float16, loss_scale_init=2.0**10)
    return fs.init(models.make_model(), fs.optim.sgd(0.1), mesh=_mesh(), policy=policy).loss_scale


def test_fp16_compute_starts_a_loss_scale_at_the_policys_value(pool2) -> None:
    assert pool2.run(fp16_worker) == [fs.LossScale(2.0**10, 0)] * 2


def by_name_worker(strategy: str) -> dict:
    mesh, model = _mesh(), models.make_model(seed=3)
    lr = 0.5
    state = fs.init(model, fs.optim.sgd(lr, momentum=0.9), mesh=mesh, strategy=strategy)
    before = {n: p.clone() for n, p in state.params.items()}
    state, _ = fs.train_step(state, _batch(0), models.make_loss_fn(model))
    momentum = state.opt_state_by_name().momentum
    # After the first SGD step the momentum buffer is the gradient: p1 = p0 - lr * buf.
    worst = max(
        float((momentum[n] - (before[n] - p) / lr).abs().max()) if p.numel() else 0.0
        for n, p in state.params.items()
    )
    mixed = fs.optim.multi_transform(
        {"m": fs.optim.adamw(1e-3), "v": fs.optim.sgd(0.1, momentum=0.9)},
        lambda name, shape: "m" if len(shape) == 2 else "v",
    )
    inner = fs.init(model, mixed, mesh=mesh, strategy=strategy).opt_state_by_name().inner
    return {
        "names": list(momentum) == list(state.params),
        "shapes": all(momentum[n].shape == p.shape for n, p in state.params.items()),
        "worst": worst,
        "some_rows": any(p.numel() for p in state.params.values()),
        "owned": {
            "m/mu": sorted(inner["m"].mu),
            "m/nu": sorted(inner["m"].nu),
            "v/momentum": sorted(inner["v"].momentum),
        },
    }


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_opt_state_by_name_keys_this_ranks_rows_by_parameter(pool2, strategy) -> None:
    names = [n for n, _ in models.make_model().named_parameters()]
    matrices = sorted(n for n in names if n.endswith("weight") and "norm" not in n)
    for r in pool2.run(by_name_worker, strategy):
        assert r["names"] and r["shapes"] and r["some_rows"], r
        assert r["worst"] < 1e-5, r  # the momentum of a name is that name's rows
        # An inner optimizer of multi_transform names only the parameters it owns.
        assert r["owned"] == {
            "m/mu": matrices,
            "m/nu": matrices,
            "v/momentum": sorted(set(names) - set(matrices)),
        }


def lifecycle_worker() -> dict:
    mesh, model = _mesh(), models.make_model()
    state = fs.init(model, fs.optim.adamw(1e-2), mesh=mesh, strategy="optim_grads_params")
    out = {}
    try:
        state.step = 3
    except AttributeError as e:
        out["setattr"] = str(e)
    later = state.replace(step=7)
    out["replace"] = (state.step, later.step, later.master[0] is state.master[0])
    copy = fs.tree.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    leaves, spec = fs.tree.flatten(state)
    out["leaf_shapes"] = [tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in leaves]
    again = fs.tree.unflatten(spec, leaves)
    out["round_trip"] = all(
        torch.equal(a, b) for a, b in zip(again.master, state.master, strict=True)
    )
    new, _ = fs.train_step(later, _batch(0), models.make_loss_fn(model))
    refused = {}
    for name, s in (("donated", later), ("replaced_from", state), ("unflattened", again)):
        try:
            s.master  # noqa: B018
            refused[name] = None
        except fs.ConsumedStateError as e:
            refused[name] = str(e)
    out["refused"] = refused
    out["repr"] = repr(later)
    out["copy_usable"] = copy.step == 0 and len(copy.master) == len(new.master)
    out["new_step"] = new.step
    out["describe"] = fs.describe(new)
    return out


def test_a_state_is_immutable_replace_shares_and_donation_refuses_the_sharers(pool2) -> None:
    results = pool2.run(lifecycle_worker)
    assert results[0]["leaf_shapes"] == results[1]["leaf_shapes"]  # the same leaf order
    for r in results:
        assert "immutable" in r["setattr"]
        assert r["replace"] == (0, 7, True), r["replace"]
        assert r["round_trip"]
        assert all(e is not None and "train_step" in e for e in r["refused"].values()), r
        assert r["repr"] == "TrainState(<consumed>)"
        assert r["copy_usable"] and r["new_step"] == 8  # replace's step went on
        assert "strategy=optim_grads_params" in r["describe"] and "buckets=" in r["describe"]


def test_init_refuses_what_is_not_an_optimizer_or_a_policy() -> None:
    with pytest.raises(TypeError, match=r"fs\.optim\.chain\(clip, adamw\)"):
        fs.init(models.make_model(), fs.optim.clip_by_global_norm(1.0), mesh=None)
    # a policy given as a string: named, not an AttributeError from deep inside
    with pytest.raises(TypeError, match=r"policy must be an fs\.MixedPrecisionPolicy.*'bf16'"):
        fs.init(models.make_model(), fs.optim.sgd(0.1), mesh=None, policy="bf16")


def test_init_refuses_a_frozen_parameter_it_would_train() -> None:
    """A parameter of requires_grad=False: before, every strategy trained it (SGD with
    momentum moved a frozen block's weight by 0.045 in 3 steps), where torch's optimizers and
    FSDP2 leave it; now fs.init names it and says how to keep it fixed."""
    model = models.make_model()
    model.blocks[0].fc.requires_grad_(False)
    with pytest.raises(
        ValueError, match=r"parameter 'blocks\.0\.fc\.weight' \(and 1 more\) has requires"
    ):
        fs.init(model, fs.optim.sgd(0.1), mesh=None)


def frozen_by_label_worker() -> float:
    """What fs.init's refusal of a frozen parameter says to do, done: the largest change of
    the labelled leaves after two steps of SGD with momentum and weight decay (ZeRO-3)."""
    model = models.make_model(seed=4)
    opt = fs.optim.multi_transform(
        {"train": fs.optim.sgd(0.5, momentum=0.9, weight_decay=0.1), "frozen": fs.optim.sgd(0.0)},
        lambda name, shape: "frozen" if name.startswith("blocks.0.") else "train",
    )
    state = fs.init(model, opt, mesh=_mesh(), strategy="optim_grads_params")
    before = {n: p.clone() for n, p in state.params.items()}
    for step in range(2):
        state, _ = fs.train_step(state, _batch(step), models.make_loss_fn(model))
    moved = {n: float((p - before[n]).abs().max()) for n, p in state.params.items() if p.numel()}
    assert moved["blocks.1.fc.weight"] > 0, moved  # the others trained
    return max(v for n, v in moved.items() if n.startswith("blocks.0."))


def test_a_zero_learning_rate_label_keeps_parameters_fixed(pool2) -> None:
    assert pool2.run(frozen_by_label_worker) == [0.0, 0.0]


def meta_worker() -> dict:
    with torch.device("meta"):
        model = models.make_model()
    state = fs.init(model, fs.optim.sgd(0.1), mesh=_mesh(), strategy="optim")
    return {"filled": state.filled, "compute_meta": all(c.is_meta for c in state.compute)}


def test_a_meta_model_gives_a_state_without_values(pool2) -> None:
    assert pool2.run(meta_worker) == [{"filled": False, "compute_meta": True}] * 2

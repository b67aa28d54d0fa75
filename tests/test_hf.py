"""Hugging Face safetensors in and out: real transformers models from tiny configs.

Loads: checkpoints written by ``save_pretrained`` (one file, or several shards and the index)
onto 2 and 3 ranks under ZeRO-3 from a meta-device model, exactly, each rank reading only its
rows. Export: ``fs.export_safetensors`` from sharded ranks, read back by ``from_pretrained`` and
``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard import checkpoint as ckpt_lib

from helpers_hf import VOCAB, make_hf


def _cpu(params: dict) -> dict:
    return {n: t.detach().cpu().clone() for n, t in params.items()}


def _file_bytes(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(directory, f))
        for f in os.listdir(directory)
        if f.endswith(".safetensors")
    )


# --- import ---------------------------------------------------------------------------------------


def import_worker(path: str, kind: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    model = make_hf(kind, meta=True)
    like = fs.init(model, fs.optim.adamw(1e-3), mesh=mesh, strategy="optim_grads_params")
    with ckpt_lib.io_stats() as io:
        state = fs.restore(path, like=like, model_only=True)
    return {"full": _cpu(fs.full_params(state)), "read": io.bytes_read}


CASES = {  # name: (model, max_shard_size of save_pretrained or None for one file, dtype)
    "llama-sharded-fp32": ("llama", "40KB", torch.float32),
    "gpt2-single-bf16": ("gpt2", None, torch.bfloat16),
    "llama-file-fp16": ("llama", None, torch.float16),
    "qwen3moe-sharded-fp32": ("qwen3moe", "40KB", torch.float32),  # per-expert tensors
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_loads_onto_zero3_from_a_meta_model(request, tmp_path, case, world):
    kind, shard_size, dtype = CASES[case]
    model = make_hf(kind).to(dtype)
    directory = str(tmp_path / "hf")
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kw)
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    assert (len(files) > 2) == (shard_size is not None), files
    path = directory if case != "llama-file-fp16" else os.path.join(directory, files[0])
    results = request.getfixturevalue(f"pool{world}").run(import_worker, path, kind)
    want = {n: p.detach().float() for n, p in model.named_parameters()}
    in_files = sum(p.numel() * p.element_size() for p in want.values()) // 4 * dtype.itemsize
    total = _file_bytes(directory)
    for r in results:
        assert set(r["full"]) >= set(want)
        for name, w in want.items():  # cast from the file's dtype to the fp32 masters: exact
            torch.testing.assert_close(r["full"][name], w, rtol=0, atol=0, msg=name)
        assert r["read"] < 1.2 * total / world, f"a rank read {r['read']} of {total} bytes"
    assert sum(r["read"] for r in results) == in_files, "every row is read exactly once"


def wrong_shape_worker(path: str) -> str | None:
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(make_hf("llama", meta=True), fs.optim.adamw(1e-3), mesh=mesh)
    try:
        fs.restore(path, like=like, model_only=True)
    except ckpt_lib.CheckpointMismatchError as e:
        return str(e)
    return None


def test_wrong_shaped_tensor_is_named_with_both_shapes(pool2, tmp_path):
    sd = {n: t.contiguous() for n, t in make_hf("llama").state_dict().items()}
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(39, 32)
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(sd, path)
    for msg in pool2.run(wrong_shape_worker, path):
        assert msg is not None
        lines = [ln for ln in msg.splitlines()[1:] if not ln.strip().startswith("the checkpoint's")]
        assert lines == [
            "  params.model.layers.1.mlp.up_proj.weight: shape (39, 32) in the "
            "checkpoint, expected (40, 32)"
        ], msg


# --- export ---------------------------------------------------------------------------------------


def export_worker(
    directory: str, kind: str, strategy: str, max_shard_bytes: int, dtype: torch.dtype | None
) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(make_hf(kind), fs.optim.adamw(1e-3), mesh=mesh, strategy=strategy)
    with ckpt_lib.io_stats() as io:
        fs.export_safetensors(directory, state, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return {"written": io.bytes_written, "names": sorted(fs.full_params(state))}


EXPORTS = {  # name: (model, strategy, max_shard_bytes, dtype)
    "llama-zero3-sharded": ("llama", "optim_grads_params", 40_000, None),
    "gpt2-tied-zero1-one-file": ("gpt2", "optim", 5 << 30, None),
    "llama-no_shard-bf16": ("llama", "no_shard", 5 << 30, torch.bfloat16),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_loads_in_transformers(pool2, tmp_path, case):
    kind, strategy, max_bytes, dtype = EXPORTS[case]
    directory = str(tmp_path / "out")
    results = pool2.run(export_worker, directory, kind, strategy, max_bytes, dtype)
    model = make_hf(kind)
    sd = model.state_dict()
    assert results[0]["names"] == sorted(sd), "full_params carries every state_dict name"
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if max_bytes < 1 << 20:
        assert len(files) > 2 and os.path.exists(
            os.path.join(directory, "model.safetensors.index.json")
        )
        weight_map = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
        assert sorted(weight_map["weight_map"]) == sorted(sd)
    else:
        assert files == ["model.safetensors"]
    total = sum(t.numel() for t in sd.values()) * (dtype or torch.float32).itemsize
    assert sum(r["written"] for r in results) == total, "every row is written exactly once"
    assert all(0 < r["written"] < total for r in results), "both ranks write their rows"

    loaded = {}
    for f in files:
        loaded.update(safetensors_torch.load_file(os.path.join(directory, f)))
    fresh = make_hf(kind, seed=1)
    fresh.load_state_dict(loaded, strict=True)
    for name, t in sd.items():
        torch.testing.assert_close(
            fresh.state_dict()[name], t.to(dtype or t.dtype).to(t.dtype), rtol=0, atol=0, msg=name
        )

    model.config.save_pretrained(directory)
    ours = type(model).from_pretrained(directory, dtype=dtype or torch.float32).eval()
    if dtype is not None:  # beside transformers' own bf16 checkpoint, loaded the same way
        model.save_pretrained(tmp_path / "ref", safe_serialization=True)
        model = type(model).from_pretrained(tmp_path / "ref", dtype=dtype).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_stacked_experts_export_as_transformers_writes_them(pool2, tmp_path):
    """A Qwen3-MoE state's stacked experts go out as transformers' own per-expert tensors:
    the names ``save_pretrained`` writes, each row written once, ``from_pretrained`` giving
    the same logits; ``split_experts=False`` writes the stacked parameters instead."""
    directory = str(tmp_path / "out")
    results = pool2.run(export_worker, directory, "qwen3moe", "optim_grads_params", 30_000, None)
    model = make_hf("qwen3moe")
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    theirs = {}
    for f in os.listdir(tmp_path / "ref"):
        if f.endswith(".safetensors"):
            theirs.update(safetensors_torch.load_file(os.path.join(tmp_path / "ref", f)))
    ours = {}
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            ours.update(safetensors_torch.load_file(os.path.join(directory, f)))
    assert sorted(ours) == sorted(theirs)
    assert any(".experts.3.up_proj.weight" in n for n in ours)
    for n, t in theirs.items():
        assert torch.equal(ours[n], t), n
    total = sum(t.numel() * t.element_size() for t in theirs.values())
    assert sum(r["written"] for r in results) == total, "every row is written exactly once"
    model.config.save_pretrained(directory)
    loaded = type(model).from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def stacked_worker(directory: str) -> None:
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(make_hf("qwen3moe"), fs.optim.adamw(1e-3), mesh=mesh, strategy="optim")
    fs.export_safetensors(directory, state, split_experts=False)


def test_stacked_experts_export_as_the_state_dict_when_asked(pool2, tmp_path):
    directory = str(tmp_path / "out")
    pool2.run(stacked_worker, directory)
    loaded = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
    model = make_hf("qwen3moe")
    fresh = make_hf("qwen3moe", seed=1)
    fresh.load_state_dict(loaded, strict=True)
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_full_params_of_tied_gpt2_loads_strictly(pool2):
    names = pool2.run(export_names_worker)[0]
    assert "lm_head.weight" in names and "transformer.wte.weight" in names


def export_names_worker() -> list[str]:
    mesh = fs.make_mesh(device_type="cpu")
    model = make_hf("gpt2")
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh)
    full = fs.full_params(state)
    fresh = make_hf("gpt2", seed=1)
    fresh.load_state_dict(full, strict=True)
    assert dist.get_world_size() == 2
    return sorted(full)


def test_the_safetensors_format_module_round_trips_headers(tmp_path) -> None:
    """``funcshard.checkpoint.safetensors`` is the format both the export and the CLI write
    through: a header made from shapes alone reads back with every entry at its offset,
    padded to 8 bytes, and files split at ``max_shard_bytes`` with the names HF expects."""
    from funcshard.checkpoint import safetensors as st

    entries = [
        st.Entry("a", "a", torch.float32, (3, 2)),
        st.Entry("b", "b", torch.bfloat16, (5,)),
        st.Entry("c", "c", torch.int64, ()),
    ]
    head, offsets = st.header_bytes(entries)
    assert len(head) % 8 == 0 and offsets == [0, 24, 34]
    path = tmp_path / "model.safetensors"
    path.write_bytes(head + bytes(sum(e.nbytes for e in entries)))
    header, data = st.read_header(str(path))
    assert data == len(head)
    assert header == {
        "a": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [5], "data_offsets": [24, 34]},
        "c": {"dtype": "I64", "shape": [], "data_offsets": [34, 42]},
    }
    assert st.is_safetensors(str(tmp_path)) and st.files(str(tmp_path)) == [str(path)]
    files = st.plan_files(entries, 30)
    assert [[e.name for e in f] for f in files] == [["a"], ["b", "c"]]
    names = st.file_names(len(files))
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    st.write_index(str(tmp_path), names, files)
    index = json.loads((tmp_path / st.INDEX).read_text())
    assert index == {
        "metadata": {"total_size": 42},
        "weight_map": {"a": names[0], "b": names[1], "c": names[1]},
    }


def transformers_ep_worker() -> dict:
    """A tiny Qwen3-MoE parallelized by transformers' own expert parallelism (its ep plan on
    mesh["expert"]), then fs.init: one ZeRO-3 step beside the plain model on the global batch."""
    import copy
    import re

    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(shard=world, expert=world, device_type="cpu")
    model = make_hf("qwen3moe").train()
    ref = copy.deepcopy(model)
    # transformers' tensor group, the ranks that share a batch: each rank its own here
    alone = [dist.new_group([r]) for r in range(world)][rank]
    tp = DeviceMesh.from_group(alone, "cpu", mesh_dim_names=("tp",))
    names = [n for n, _ in (*model.named_modules(), *model.named_parameters())]
    plan = {}
    for key, style in model.config.base_model_ep_plan.items():  # its wildcards, expanded
        pattern = re.compile("model." + re.escape(key).replace(r"\*", r"\d+") + "$")
        plan.update({n: style for n in names if pattern.match(n)})
    apply_expert_parallelism(model, mesh["expert"], tp, plan)
    local = tuple(model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape)
    state = fs.init(model, fs.optim.sgd(0.1), mesh=mesh, strategy="optim_grads_params")
    tokens = torch.randint(0, VOCAB, (2 * world, 9), generator=torch.Generator().manual_seed(0))

    def loss_of(m, params, t):
        out = fs.functional_call(m, params, (t[:, :-1],)) if params else m(t[:, :-1])
        logits = out.logits.reshape(-1, VOCAB)
        return torch.nn.functional.cross_entropy(logits, t[:, 1:].reshape(-1))

    loss_fn = lambda p, b: loss_of(model, p, b)  # noqa: E731
    state, _ = fs.train_step(state, tokens.chunk(world)[rank], loss_fn)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_of(ref, None, tokens).backward()
    opt.step()
    full = fs.full_params(state)
    err = max((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return {"err": err, "local": local, "global": tuple(full[plan_name(plan)].shape)}


def plan_name(plan: dict) -> str:
    return next(n for n, s in plan.items() if s == "grouped_gemm")


def test_transformers_expert_parallelism_then_fs_init_trains_as_one_process(pool2) -> None:
    """The path docs/expert-parallel.md gives for transformers' MoE models (whose experts take
    ``(hidden, top_k_index, top_k_weights)``, not fs.ExpertParallel's signature): each rank
    holds half the experts, and the step equals the plain model's on the global batch."""
    for r in pool2.run(transformers_ep_worker):
        assert r["local"] == (2, 24, 32) and r["global"] == (4, 24, 32), r
        assert r["err"] < 1e-5, r

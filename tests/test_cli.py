"""``python -m funcshard inspect | verify | convert`` on a 2-rank checkpoint of a small Llama.

Convert round trips: to safetensors (transformers' ``from_pretrained`` gives the same logits),
to DCP (``dcp.load`` fills a plain model's state_dict), and from those back to funcshard's
Orbax layout (``fs.restore(..., model_only=True)`` on 2 ranks gives the same weights).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers

import funcshard as fs
from funcshard.checkpoint import cli

import helpers_checksums
import helpers_hf

VOCAB = helpers_hf.VOCAB


def make_llama(seed: int = 0) -> torch.nn.Module:
    return helpers_hf.make_hf("llama", seed)


def save_worker(directory: str) -> None:
    mesh = fs.make_mesh(device_type="cpu")
    state = fs.init(make_llama(), fs.optim.adamw(1e-3), mesh=mesh, strategy="optim_grads_params")
    fs.save(directory, state)


def restore_worker(directory: str) -> dict:
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(make_llama(seed=1), fs.optim.adamw(1e-3), mesh=mesh, strategy="optim")
    state = fs.restore(directory, like=like, model_only=True)
    return {n: t.detach().cpu().clone() for n, t in fs.full_params(state).items()}


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("cli") / "ckpt")
    pool2.run(save_worker, directory)
    return directory


def _run(capsys, *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    return status, capsys.readouterr().out


def _plain_state_dict() -> dict[str, torch.Tensor]:
    return make_llama().state_dict()


def test_inspect_through_python_m(saved):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "funcshard", "inspect", saved],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "format: funcshard (Orbax layout)" in out and "step: 0" in out, out
    assert "checksums: crc32c" in out
    # leaf, global shape, dtype, bytes, chunks (one per writing rank)
    row = "params.model.embed_tokens.weight".ljust(10)
    line = next(x for x in out.splitlines() if x.startswith(row))
    assert line.split()[1:] == ["(101,", "32)", "float32", str(101 * 32 * 4), "2"], line
    assert any(x.startswith("opt_state.nu.lm_head.weight") for x in out.splitlines())


def test_verify_names_each_bad_leaf(saved, tmp_path, capsys):
    status, out = _run(capsys, "verify", saved)
    assert status == 0 and "OK" in out, out
    bad = str(tmp_path / "bad")
    shutil.copytree(saved, bad)
    flipped = ["params.model.norm.weight", "opt_state.nu.model.layers.1.mlp.up_proj.weight"]
    for leaf in flipped:
        with open(os.path.join(bad, leaf, "0.0" if "proj" in leaf else "0"), "r+b") as f:
            f.seek(5)
            byte = f.read(1)[0]
            f.seek(5)
            f.write(bytes([byte ^ 0x10]))
    status, out = _run(capsys, "verify", bad)
    named = sorted(x.split()[1].rstrip(":") for x in out.splitlines() if x.startswith("BAD "))
    assert status == 1 and named == sorted(flipped), out
    assert "bytes 0:" in out
    os.remove(os.path.join(bad, "_CHECKSUMS"))  # lost, though the save recorded them
    status, out = _run(capsys, "verify", bad)
    assert status == 1 and "_CHECKSUMS is missing" in out, out


@pytest.mark.parametrize("case", list(helpers_checksums.TAMPERING))
def test_verify_names_damaged_metadata(saved, tmp_path, capsys, case):
    bad = str(tmp_path / "bad")
    shutil.copytree(saved, bad)
    path = helpers_checksums.TAMPERING[case](bad)
    status, out = _run(capsys, "verify", bad)
    assert status == 1 and "BAD" in out and path in out, out


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_convert_to_safetensors_loads_in_transformers(saved, tmp_path, capsys, dtype):
    out = str(tmp_path / "hf")
    argv = ["convert", saved, out, "--to=safetensors"] + ([f"--dtype={dtype}"] if dtype else [])
    assert _run(capsys, *argv)[0] == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    model = make_llama()
    model.config.save_pretrained(out)
    torch_dtype = torch.bfloat16 if dtype else torch.float32
    ours = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch_dtype).eval()
    for name, t in model.state_dict().items():
        torch.testing.assert_close(
            ours.state_dict()[name], t.to(torch_dtype), rtol=0, atol=0, msg=name
        )
    if dtype is None:
        ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(ours(ids).logits, model(ids).logits, rtol=0, atol=0)
    status, listing = _run(capsys, "inspect", out)
    assert status == 0 and "format: Hugging Face safetensors" in listing


def test_convert_to_dcp_and_back_to_orbax(pool2, saved, tmp_path, capsys):
    out = str(tmp_path / "dcp")
    assert _run(capsys, "convert", saved, out, "--to=dcp")[0] == 0
    want = _plain_state_dict()
    fresh = make_llama(seed=3).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: DCP says so
        dcp.load(fresh, checkpoint_id=out)
    for name, t in want.items():
        torch.testing.assert_close(fresh[name], t, rtol=0, atol=0, msg=name)
    status, listing = _run(capsys, "inspect", out)
    assert status == 0 and "format: torch.distributed.checkpoint (DCP)" in listing
    status, listing = _run(capsys, "verify", out)
    assert status == 2 and "cannot be verified" in listing, listing

    # DCP and safetensors -> funcshard's Orbax layout, restored model_only on 2 ranks
    hf_dir = str(tmp_path / "hf")
    assert _run(capsys, "convert", saved, hf_dir, "--to=safetensors")[0] == 0
    for src in (out, hf_dir):
        orbax = src + "-orbax"
        assert _run(capsys, "convert", src, orbax, "--to=orbax")[0] == 0
        assert _run(capsys, "verify", orbax)[0] == 0
        for got in pool2.run(restore_worker, orbax):
            for name, t in want.items():
                torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=f"{src}: {name}")


def test_convert_refuses_an_existing_destination(saved, tmp_path, capsys):
    status = cli.main(["convert", saved, str(tmp_path), "--to=orbax"])
    assert status == 1 and "already exists" in capsys.readouterr().err

"""Checkpoint save/restore time: funcshard (Orbax layout, tensorstore) beside torch DCP.

On gloo CPU ranks, one AdamW ZeRO-3 state (masters + mu + nu, fp32):

* save and same-layout restore at 2 ranks, funcshard vs ``torch.distributed.checkpoint``
  (DCP, DTensor shards, ``sync_files=True``), best of ``--reps``;
* funcshard's save and restore with and without chunk checksums, interleaved rep by rep so
  that both see the same machine;
* the peak memory (max RSS) of ``python -m funcshard convert`` of a Llama's training
  checkpoint (``--hf_dim`` wide) to each format, beside the interpreter's own;
* the 2 -> 3 resharding restore vs a 3 -> 3 same-layout restore (both at 3 ranks);
* ``--parts=memory``: the peak memory of a restore above what the rank held before it
  (its resident high-water mark, ``funcshard.testing.PeakMemory``, in fresh processes),
  against the bytes of the state restored: same layout, onto ZeRO-1 with half the optimizer
  offloaded, model-only, and resharded onto nproc + 1 ranks;
* funcshard's durable write bandwidth vs this disk's ``fdatasync`` bandwidth, measured in the
  same run by every rank writing and syncing its share of bytes at once;
* Hugging Face safetensors of a Llama (``transformers``, fp32, ``--hf_dim`` wide): export at 2
  ranks (ZeRO-3) beside ``safetensors.torch.save_file`` of the full model on one rank, and
  import into a meta-device model at 2 ranks beside ``safetensors.torch.load_file`` and
  ``LlamaForCausalLM.from_pretrained`` (transformers' loading path) on one rank.

Restores read what was just written, so they mostly measure the page cache; both sides alike.
``--device=cuda --nproc=1`` runs the save / restore and safetensors rows from GPU state on one
GPU (NCCL; the resharding rows need more ranks than a one-GPU machine has and are skipped).

    python experiments/bench_checkpoint.py --dim=1536 --layers=8
    python experiments/bench_checkpoint.py --parts=checksums --reps=5   # checksums' cost only
    python experiments/bench_checkpoint.py --parts=memory               # restore's peak memory
    python experiments/bench_checkpoint.py --device=cuda --nproc=1 --dim=4096 --layers=16
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from absl import app, flags
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import funcshard as fs
from funcshard import checkpoint as ckpt_lib
from funcshard.testing import PeakMemory, state_bytes

DIM = flags.DEFINE_integer("dim", 1536, "width of the square Linear layers")
LAYERS = flags.DEFINE_integer("layers", 8, "number of Linear layers")
REPS = flags.DEFINE_integer("reps", 2, "repetitions; the best time is reported")
CHUNK_MIB = flags.DEFINE_float("chunk_mib", None, "override funcshard's zarr chunk target (MiB)")
HF_DIM = flags.DEFINE_integer("hf_dim", 512, "hidden size of the Llama of the safetensors rows")
DIR = flags.DEFINE_string("dir", None, "scratch directory (default: a fresh temporary one)")
DEVICE = flags.DEFINE_enum("device", "cpu", ["cpu", "cuda"], "where the state lives")
PARTS = flags.DEFINE_list(
    "parts",
    ["dcp", "reshard", "hf", "checksums", "convert"],
    "rows to run beside funcshard's save / restore: dcp, reshard, hf, checksums (the same "
    "save / restore without checksums, interleaved with the one with them), convert (peak "
    "memory of python -m funcshard convert of the --hf_dim Llama's training checkpoint); "
    "memory alone: the peak memory of fs.restore (and nothing else)",
)
NPROC = flags.DEFINE_integer(
    "nproc",
    2,
    "ranks of the save / restore and safetensors rows "
    "(the reshard rows restore them onto nproc + 1, CPU only)",
)


def _model(dim: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))


def _chunk_bytes(chunk_mib: float | None) -> int:
    return ckpt_lib.CHUNK_BYTES if chunk_mib is None else int(chunk_mib * (1 << 20))


def _state(dim: int, layers: int, device: str) -> tuple[fs.TrainState, nn.Module]:
    model = _model(dim, layers)
    mesh = fs.make_mesh(device_type=device)
    state = fs.init(model, fs.optim.adamw(1e-3), mesh=mesh, strategy="optim_grads_params")
    x = torch.randn(2, dim, device=device)

    def loss_fn(params, batch):
        return fs.functional_call(model, params, (batch,)).square().mean()

    state, _ = fs.train_step(state, x, loss_fn)  # non-trivial optimizer state
    return state, model


def _timed(fn) -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():  # a restore's copies to the GPU are part of it
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def _best(fn, reps: int, setup=None) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        times.append(_timed(fn))
    return min(times)


def _rm(path: str) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def _dcp_state(state: fs.TrainState) -> dict:
    """The same shards as DTensors (uneven splits need the global shape and stride)."""
    mesh = state.mesh["shard"]
    layout = state.layout

    def dt(local: dict) -> dict:
        out = {}
        for spec in layout.leaves:
            shape = torch.Size(spec.shape)
            out[spec.name] = DTensor.from_local(
                local[spec.name], mesh, [Shard(0)], shape=shape, stride=torch.empty(shape).stride()
            )
        return out

    opt = state.opt_state_by_name()
    return {"params": dt(state.params), "mu": dt(opt.mu), "nu": dt(opt.nu), "step": state.step}


def _fdatasync_seconds(path: str, nbytes: int) -> float:
    """Every rank writes and fdatasyncs ``nbytes`` at once; the time of the slowest."""
    block = os.urandom(1 << 20) * 16
    fname = f"{path}.rank{dist.get_rank()}"

    def write() -> None:
        fd = os.open(fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, block[: min(left, len(block))])
            os.fdatasync(fd)
        finally:
            os.close(fd)

    t = _timed(write)
    os.remove(fname)
    return t


def bench_two(
    root: str,
    dim: int,
    layers: int,
    reps: int,
    chunk_mib: float | None,
    device: str = "cpu",
    checksums_too: bool = True,
    dcp_too: bool = True,
) -> dict:
    state, _ = _state(dim, layers, device)
    chunk = _chunk_bytes(chunk_mib)
    n_params = sum(s.numel for s in state.layout.leaves)
    total = 3 * 4 * n_params  # bytes in the files: masters, mu, nu (fp32, no padding)
    ours, theirs = os.path.join(root, "fs2"), os.path.join(root, "dcp2")
    out = {"params": n_params, "bytes": total}
    out["fs_save"] = _best(
        lambda: fs.save(ours, state, chunk_bytes=chunk), reps, setup=lambda: _rm(ours)
    )
    like = [state]

    def restore_ours() -> None:
        like[0] = fs.restore(ours, like=like[0])

    out["fs_restore"] = _best(restore_ours, reps)
    if checksums_too:  # the same, without checksums, interleaved so both see the same load
        bare = os.path.join(root, "fs2-bare")
        bare_saver = ckpt_lib.Saver(chunk_bytes=chunk, checksums=False)
        times: dict[str, list[float]] = {
            k: [] for k in ("save", "restore", "bare_save", "bare_restore")
        }

        def restore(path: str) -> None:
            with warnings.catch_warnings():  # the bare one has no checksums: it warns so
                warnings.simplefilter("ignore", ckpt_lib.UnverifiedCheckpointWarning)
                like[0] = fs.restore(path, like=like[0])

        for _ in range(reps):
            for name, path, save in (
                ("", ours, lambda p: fs.save(p, like[0], chunk_bytes=chunk)),
                ("bare_", bare, lambda p: bare_saver.save(p, like[0])),
            ):
                _rm(path)
                times[name + "save"].append(_timed(lambda p=path, s=save: s(p)))
                times[name + "restore"].append(_timed(lambda p=path: restore(p)))
        out.update({f"cs_{k}": min(v) for k, v in times.items()})
    if dcp_too:
        sd = _dcp_state(like[0])
        out["dcp_save"] = _best(
            lambda: dcp.save(sd, checkpoint_id=theirs), reps, setup=lambda: _rm(theirs)
        )
        out["dcp_restore"] = _best(lambda: dcp.load(sd, checkpoint_id=theirs), reps)
    out["fdatasync"] = min(
        _fdatasync_seconds(os.path.join(root, "sync"), total // 2) for _ in range(reps)
    )
    out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return out


def bench_three(root: str, dim: int, layers: int, reps: int, chunk_mib: float | None) -> dict:
    state, _ = _state(dim, layers, "cpu")
    same = os.path.join(root, "fs3")
    _rm(same)
    fs.save(same, state, chunk_bytes=_chunk_bytes(chunk_mib))
    like = [state]

    def restore(path: str):
        def run() -> None:
            like[0] = fs.restore(path, like=like[0])

        return run

    return {
        "reshard": _best(restore(os.path.join(root, "fs2")), reps),
        "same": _best(restore(same), reps),
    }


def _llama(dim: int, layers: int, meta: bool) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=dim,
        intermediate_size=dim * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(dim // 64, 1),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)
    return transformers.LlamaForCausalLM(config)


def bench_hf(root: str, dim: int, layers: int, reps: int, device: str = "cpu") -> dict:
    """Safetensors export / import at nproc ranks beside one-rank safetensors and transformers."""
    import safetensors.torch
    import transformers

    model = _llama(dim, layers, meta=False)
    mesh = fs.make_mesh(device_type=device)
    state = fs.init(model, fs.optim.adamw(1e-3), mesh=mesh, strategy="optim_grads_params")
    ours, theirs = os.path.join(root, "hf_fs"), os.path.join(root, "hf_st")
    out = {"params": sum(p.numel() for p in model.parameters())}
    out["fs_export"] = _best(
        lambda: fs.export_safetensors(ours, state), reps, setup=lambda: _rm(ours)
    )
    full = {n: t.contiguous() for n, t in model.state_dict().items()}
    one = os.path.join(theirs, "model.safetensors")

    def save_one() -> None:  # made durable, as export_safetensors makes its files
        if dist.get_rank() == 0:
            safetensors.torch.save_file(full, one)
            fd = os.open(one, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def setup_one() -> None:
        _rm(theirs)
        if dist.get_rank() == 0:
            os.makedirs(theirs)
        dist.barrier()

    out["st_save"] = _best(save_one, reps, setup=setup_one)
    if dist.get_rank() == 0:
        model.config.save_pretrained(ours)
    dist.barrier()
    like = [None]

    def fresh_like() -> None:  # plain SGD: no optimizer state to create, only the weights
        like[0] = fs.init(
            _llama(dim, layers, meta=True),
            fs.optim.sgd(1e-3),
            mesh=mesh,
            strategy="optim_grads_params",
        )

    def restore_ours() -> None:
        like[0] = fs.restore(ours, like=like[0], model_only=True)

    out["fs_import"] = _best(restore_ours, reps, setup=fresh_like)
    rank0 = lambda fn: lambda: fn() if dist.get_rank() == 0 else None
    out["st_load"] = _best(rank0(lambda: safetensors.torch.load_file(one)), reps)
    # load_file maps the file: the bytes are read when first touched; here every one is
    out["st_load_copy"] = _best(
        rank0(lambda: [t.clone() for t in safetensors.torch.load_file(one).values()]), reps
    )
    out["hf_load"] = _best(rank0(lambda: transformers.LlamaForCausalLM.from_pretrained(ours)), reps)
    return out


def convert_save(directory: str, dim: int, layers: int) -> dict:
    """A training checkpoint of the Llama (AdamW) to convert, and its largest leaf."""
    state = fs.init(
        _llama(dim, layers, meta=False),
        fs.optim.adamw(1e-3),
        mesh=fs.make_mesh(device_type="cpu"),
        strategy="optim_grads_params",
    )
    fs.save(directory, state)
    sizes = [s.numel * 4 for s in state.layout.leaves]
    return {"params": sum(s.numel for s in state.layout.leaves), "largest": max(sizes)}


def _max_rss_mb(*args: str) -> float:
    """Peak resident memory of ``python args...`` run alone (its own rusage, by wait4)."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"python {' '.join(args)} exited {proc.returncode}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def bench_convert(root: str, dim: int, layers: int) -> dict:
    """Peak memory of ``python -m funcshard convert`` to each format, beside the interpreter."""
    src = os.path.join(root, "convert-src")
    _rm_local(src)
    info = fs.launch(convert_save, src, dim, layers, nproc=2)[0]
    out = {"base": _max_rss_mb("-c", "import funcshard.checkpoint.cli"), **info}
    for name, extra in (
        ("safetensors", ()),
        ("safetensors --dtype=bf16", ("--dtype=bf16",)),
        ("dcp", ()),
        ("orbax", ()),
    ):
        dst = os.path.join(root, "convert-out")
        _rm_local(dst)
        to = name.split()[0]
        out[name] = _max_rss_mb("-m", "funcshard", "convert", src, dst, f"--to={to}", *extra)
    _rm_local(dst)
    _rm_local(src)
    return out


MEMORY_CASES = (  # name, strategy, offload fraction, model_only
    ("same layout (ZeRO-3)", "optim_grads_params", 0.0, False),
    ("ZeRO-1, half offloaded", "optim", 0.5, False),
    ("model only (ZeRO-3)", "optim_grads_params", 0.0, True),
)


def memory_save(directory: str, dim: int, layers: int) -> None:
    fs.save(directory, _state(dim, layers, "cpu")[0])


def memory_restore(directory: str, dim: int, layers: int) -> list[dict]:
    """Each case's peak memory of ``fs.restore`` above the rank's before it, and its state's
    bytes (``like`` stays referenced meanwhile, as a caller's ``state`` would)."""
    mesh = fs.make_mesh(device_type="cpu")
    out = []
    for _, strategy, offload, model_only in MEMORY_CASES:
        opt = fs.optim.adamw(1e-3)
        like = fs.init(
            _model(dim, layers), opt, mesh=mesh, strategy=strategy, offload_fraction=offload
        )
        with PeakMemory() as peak:
            state = fs.restore(directory, like=like, model_only=model_only)
        out.append({"extra": peak.extra, "state": state_bytes(state)})
        del like, state
    return out


def bench_memory(root: str, dim: int, layers: int, nproc: int) -> dict:
    """Peak memory of restores at nproc and nproc + 1 ranks of a checkpoint saved at nproc,
    each in fresh processes whose freed blocks go back to the kernel at once."""
    src = os.path.join(root, "memory-src")
    _rm_local(src)
    fs.launch(memory_save, src, dim, layers, nproc=nproc)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the ranks inherit it
    try:
        return {
            world: fs.launch(memory_restore, src, dim, layers, nproc=world)
            for world in (nproc, nproc + 1)
        }
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        _rm_local(src)


def _print_memory(memory: dict, dim: int, layers: int) -> None:
    n = dim * dim * layers + dim * layers
    print(f"\nfs.restore peak memory: {n / 1e6:.1f}M params + AdamW, the worst rank of each")
    print(f"{'restore':<36}{'state MiB':>10}{'peak extra MiB':>16}{'/ state':>9}")
    saved = min(memory)
    for world, ranks in memory.items():
        for i, (name, *_) in enumerate(MEMORY_CASES):
            worst = max(ranks, key=lambda r: r[i]["extra"] / r[i]["state"])[i]
            label = f"{saved} -> {world} ranks, {name}"
            mib = worst["state"] / 2**20, worst["extra"] / 2**20
            print(
                f"{label:<36}{mib[0]:>10.1f}{mib[1]:>16.1f}{worst['extra'] / worst['state']:>9.2f}"
            )


def _rm_local(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        return "unknown"
    return f"{names[0]}, {len(names)} cores" if names else "unknown"


def main(argv: list[str]) -> None:
    del argv
    root = DIR.value or tempfile.mkdtemp(prefix="bench_checkpoint_")
    os.makedirs(root, exist_ok=True)
    if PARTS.value == ["memory"]:
        try:
            memory = bench_memory(root, DIM.value, LAYERS.value, NPROC.value)
        finally:
            if DIR.value is None:
                shutil.rmtree(root, ignore_errors=True)
        print(f"CPU: {_cpu_name()}")
        _print_memory(memory, DIM.value, LAYERS.value)
        return
    try:
        two = fs.launch(
            bench_two,
            root,
            DIM.value,
            LAYERS.value,
            REPS.value,
            CHUNK_MIB.value,
            DEVICE.value,
            "checksums" in PARTS.value,
            "dcp" in PARTS.value,
            nproc=NPROC.value,
        )[0]
        three = (
            None
            if DEVICE.value == "cuda" or "reshard" not in PARTS.value
            else fs.launch(
                bench_three,
                root,
                DIM.value,
                LAYERS.value,
                REPS.value,
                CHUNK_MIB.value,
                nproc=NPROC.value + 1,
            )[0]
        )
        convert = None
        if "convert" in PARTS.value:
            convert = bench_convert(root, HF_DIM.value, LAYERS.value)
        hf = None
        if "hf" in PARTS.value:
            hf = fs.launch(
                bench_hf,
                root,
                HF_DIM.value,
                LAYERS.value,
                REPS.value,
                DEVICE.value,
                nproc=NPROC.value,
            )[0]
    finally:
        if DIR.value is None:
            shutil.rmtree(root, ignore_errors=True)
    mb = two["bytes"] / 1e6
    n, m = NPROC.value, NPROC.value + 1
    where = f"state on {two['device']}" if DEVICE.value == "cuda" else f"reshard at {m}"
    print(
        f"model: {two['params'] / 1e6:.1f}M params; AdamW state in files {mb:.0f} MB; "
        f"{n} ranks ({where}), best of {REPS.value}"
    )
    print(f"CPU: {_cpu_name()}")
    if "dcp_save" in two:
        print(f"{'operation':<34}{'funcshard s':>12}{'DCP s':>10}{'ratio':>8}")
        for op in ("save", "restore"):
            a, b = two[f"fs_{op}"], two[f"dcp_{op}"]
            print(f"{op + f' ({n} ranks, same layout)':<34}{a:>12.3f}{b:>10.3f}{a / b:>8.2f}")
    if "cs_save" in two:
        print(f"\nchecksums (crc32c per 1 MiB block), {n} ranks, interleaved, best of {REPS.value}")
        print(f"{'operation':<34}{'with s':>12}{'without s':>10}{'ratio':>8}")
        for op in ("save", "restore"):
            a, b = two[f"cs_{op}"], two[f"cs_bare_{op}"]
            print(f"{op:<34}{a:>12.3f}{b:>10.3f}{a / b:>8.3f}")
    if three is not None:
        print(f"{f'restore {n} -> {m} (reshard)':<34}{three['reshard']:>12.3f}")
        print(f"{f'restore {m} -> {m} (same layout)':<34}{three['same']:>12.3f}")
        print(
            f"reshard / same-layout restore: {three['reshard'] / three['same']:.2f}x "
            "(target <= 1.2)"
        )
    if "dcp_save" in two:
        print(
            f"funcshard / DCP save time: {two['fs_save'] / two['dcp_save']:.2f}x, "
            f"restore time: {two['fs_restore'] / two['dcp_restore']:.2f}x (target <= 1)"
        )
    bw_ours, bw_disk = mb / two["fs_save"], mb / two["fdatasync"]
    print(
        f"durable write bandwidth: funcshard {bw_ours:.0f} MB/s, fdatasync {bw_disk:.0f} MB/s "
        f"({bw_ours / bw_disk:.2f} of the disk)"
    )
    if convert is not None:
        base, leaf = convert["base"], convert["largest"] / (1 << 20)
        print(
            f"\npython -m funcshard convert: Llama {convert['params'] / 1e6:.1f}M params + AdamW "
            f"(largest leaf {leaf:.0f} MiB); interpreter and imports alone {base:.0f} MiB"
        )
        print(f"{'--to':<28}{'max RSS MiB':>12}{'over imports / largest leaf':>30}")
        for name in ("safetensors", "safetensors --dtype=bf16", "dcp", "orbax"):
            mb = convert[name]
            print(f"{name:<28}{mb:>12.0f}{(mb - base) / leaf:>30.2f}")
    if hf is None:
        return
    print(
        f"\nHugging Face safetensors: Llama {hf['params'] / 1e6:.1f}M params, fp32; funcshard at "
        f"{n} ranks (ZeRO-3, import into a meta-device model), the others on one rank"
    )
    print(f"{'operation':<46}{'s':>8}{'funcshard / it':>16}")
    rows = [
        (f"fs.export_safetensors ({n} ranks)", hf["fs_export"]),
        ("safetensors.torch.save_file + fsync (1 rank)", hf["st_save"]),
        (f"fs.restore(model_only) of it ({n} ranks)", hf["fs_import"]),
        ("safetensors.torch.load_file, mmap (1 rank)", hf["st_load"]),
        ("load_file + copy every tensor (1 rank)", hf["st_load_copy"]),
        ("LlamaForCausalLM.from_pretrained (1 rank)", hf["hf_load"]),
    ]
    for name, t in rows:
        ref = hf["fs_export"] if "save" in name or "export" in name else hf["fs_import"]
        print(f"{name:<46}{t:>8.3f}{ref / t:>16.2f}")


if __name__ == "__main__":
    app.run(main)

"""Restore reads into ``like``'s own buffers: its peak memory stays within 10% of the state.

One AdamW checkpoint saved at 2 ranks (ZeRO-3), restored in fresh processes onto the same
layout, onto ZeRO-1 with half the optimizer offloaded (a full compute copy to rebuild), model
only, and at 3 ranks (a resharding read that cuts through chunks and checksum blocks). Each
rank measures the high-water mark of its resident memory during ``fs.restore`` above what it
held before (``funcshard.testing.PeakMemory``), against the bytes of the state it restores.
Reading into new buffers, as restore once did, costs about the whole state again.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard.testing import PeakMemory, state_bytes

DIM, LAYERS = 1024, 16  # 16.8M params: 100 MB of AdamW state a rank at 2 ranks
BOUND = 0.10  # peak extra memory of a restore / the state's bytes
CASES = {  # name: (strategy, offload fraction, model_only)
    "same layout": ("optim_grads_params", 0.0, False),
    "zero1 + offload": ("optim", 0.5, False),
    "model only": ("optim_grads_params", 0.0, True),
}


def _model(dim: int = DIM) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(LAYERS)))


def _loss_fn(model: nn.Module):
    def loss_fn(params, x):
        return fs.functional_call(model, params, (x,)).square().mean()

    return loss_fn


def save_worker(directory: str, dim: int = DIM) -> None:
    model = _model(dim)
    state = fs.init(model, fs.optim.adamw(1e-3), mesh=fs.make_mesh(device_type="cpu"))
    state, _ = fs.train_step(state, torch.randn(4, dim), _loss_fn(model))
    fs.save(directory, state)


def measure_worker(directory: str, cases: list[tuple[str, float, bool]]) -> list[dict]:
    import tensorstore  # noqa: F401 (funcshard imports it at a checkpoint's first use: its
    # modules, about 20 MB once a process, are not a restore's scratch)

    mesh = fs.make_mesh(device_type="cpu")
    out = []
    for strategy, offload, model_only in cases:
        like = fs.init(
            _model(), fs.optim.adamw(1e-3), mesh=mesh, strategy=strategy, offload_fraction=offload
        )
        with PeakMemory() as peak:  # ``like`` stays referenced here, as a caller's would
            state = fs.restore(directory, like=like, model_only=model_only)
        out.append(
            {
                "extra": peak.extra,
                "state": state_bytes(state),
                "step": state.step,
                "consumed": like.consumed,
            }
        )
        del like, state
    return out


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("restore_memory") / "ckpt")
    pool2.run(save_worker, directory)
    return directory


@pytest.mark.parametrize("world", [2, 3], ids=["2->2", "2->3"])
def test_restore_peak_memory_is_within_a_tenth_of_the_state(saved, monkeypatch, world):
    # fresh processes whose freed blocks go back to the kernel at once (no reuse to hide
    # an allocation); the ranks inherit the environment
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    cases = list(CASES.values())
    results = fs.launch(measure_worker, saved, cases, nproc=world)
    for rank, per_rank in enumerate(results):
        for name, r in zip(CASES, per_rank, strict=True):
            ratio = r["extra"] / r["state"]
            what = (
                f"rank {rank}, {name}: {r['extra'] / 2**20:.1f} MiB over {r['state'] / 2**20:.1f}"
            )
            assert ratio <= BOUND, f"{what} MiB of state ({ratio:.2f}x)"
            assert r["consumed"] and r["step"] == (0 if CASES[name][2] else 1), r


SMALL_DIM = 512  # 4.2M params: 16 MiB of AdamW state a rank at 3 ranks
SMALL_BOUND = 0.05  # a small state's scratch / its bytes (documented: about 0.01x)


def small_worker(directory: str) -> dict:
    """Two restores at this world; the second one's peak memory: the process's own first-use
    costs (gloo's first all-reduce, malloc arenas of the read threads) went to the first."""
    mesh = fs.make_mesh(device_type="cpu")
    extra = []
    for _ in range(2):
        like = fs.init(_model(SMALL_DIM), fs.optim.adamw(1e-3), mesh=mesh)
        with PeakMemory() as peak:
            state = fs.restore(directory, like=like)
        extra.append(peak.extra)
        del like
    return {"extra": extra[1], "state": state_bytes(state)}


def test_a_small_state_pays_little_scratch(pool2, tmp_path, monkeypatch):
    """Saved at 2 ranks, restored at 3: the resharding read cuts checksum blocks. Their
    bytes outside a rank's rows used to land in a whole 1 MiB block of scratch a read thread
    (and the check read every block whole): a floor of ~4 MiB, 0.25x of a 16 MiB state."""
    directory = str(tmp_path / "small")
    pool2.run(save_worker, directory, SMALL_DIM)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for rank, r in enumerate(fs.launch(small_worker, directory, nproc=3)):
        ratio = r["extra"] / r["state"]
        what = f"rank {rank}: {r['extra'] / 2**20:.2f} MiB over {r['state'] / 2**20:.1f} MiB"
        assert ratio <= SMALL_BOUND, f"{what} of state ({ratio:.3f}x)"


def _consumed_error_worker(directory: str) -> dict:
    """A restore that fails after ``like`` was written into (a read error once every rank
    checked): ``like`` then refuses use on every rank, naming the failed restore."""
    from funcshard.checkpoint import orbax

    like = fs.init(_model(), fs.optim.adamw(1e-3), mesh=fs.make_mesh(device_type="cpu"))
    real = orbax.OrbaxSource.read_into

    def failing(self, requests):
        if dist.get_rank() == 1:
            raise OSError("disk gone mid-read")
        return real(self, requests)

    orbax.OrbaxSource.read_into = failing
    try:
        fs.restore(directory, like=like)
        error = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}"
    finally:
        orbax.OrbaxSource.read_into = real
    try:
        _ = like.params
        refused = None
    except fs.ConsumedStateError as e:
        refused = str(e)
    return {"error": error, "refused": refused}


def test_a_read_that_fails_after_the_check_spoils_like_on_every_rank(pool2, saved):
    for rank, r in enumerate(pool2.run(_consumed_error_worker, saved)):
        assert r["error"] is not None, f"rank {rank}: silent success"
        assert "disk gone mid-read" in r["error"], r
        assert r["refused"] is not None, f"rank {rank}: like usable with half-restored values"
        assert "restore from" in r["refused"] and "failed while reading" in r["refused"], r
        # the whole cause, on the rank that read fine too (its error quotes rank 1's)
        assert "disk gone mid-read" in r["refused"], r

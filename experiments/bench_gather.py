"""One ZeRO-3 gather of a GPT block on gloo: funcshard's beside FSDP2's way.

A block's params are sharded by rows; each rank holds its rows of every leaf in one flat
buffer, and a gather must give every leaf whole (its ranks' rows adjacent). Timed on CPU gloo
ranks, alternated in one run:

* collective: ``all_gather_into_tensor`` then the copy of each leaf's rows into place
  (``torch.split_with_sizes_copy``), as FSDP2 does it (and funcshard on NCCL, which writes the
  gathered buffer in place). gloo gathers into a buffer of its own and copies the result out.
* funcshard: ``funcshard.distributed.ops.all_gather_pieces``, which on gloo sends each leaf's rows
  straight to where they belong on every peer (small leaves travel together).

Reported per gather: median wall ms, the CPU ms of the rank's process (gloo's threads
included), and funcshard / collective. Both results are checked equal first.

Run:  python experiments/bench_gather.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from absl import app, flags

import funcshard as fs
from funcshard.distributed import ops

FLAGS = flags.FLAGS
flags.DEFINE_integer("nproc", 2, "gloo ranks (the shard size)")
flags.DEFINE_integer("d_model", 512, "block width (the bench_step GPT's)")
flags.DEFINE_integer("repeats", 30, "timed gathers per way (alternated)")


def _block_sizes(d: int, ranks: int) -> list[int]:
    """Per-rank piece sizes of a GPT block's leaves (rows split evenly over ranks): two
    LayerNorms, attention qkv and projection, the MLP, each weight with its bias."""
    leaves = [(d, 1), (d, 1), (3 * d, d), (3 * d, 1), (d, d), (d, 1)]
    leaves += [(d, 1), (d, 1), (4 * d, d), (4 * d, 1), (d, 4 * d), (d, 1)]
    return [-(-rows // ranks) * numel for rows, numel in leaves]


def _collective(local: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    size = dist.get_world_size(group)
    gathered = torch.empty(size * local.numel())
    dist.all_gather_into_tensor(gathered, local, group=group)
    out = torch.empty_like(gathered)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    pieces = [
        out[size * o : size * (o + n)].view(size, n)
        for o, n in zip(offsets[:-1], sizes, strict=True)
    ]
    torch.split_with_sizes_copy(gathered.view(size, -1), sizes, dim=1, out=pieces)
    return out


def _worker(d_model: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    group = dist.group.WORLD
    sizes = _block_sizes(d_model, dist.get_world_size())
    local = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(dist.get_rank()))
    ways = {
        "collective": lambda: _collective(local, sizes, group),
        "funcshard": lambda: ops.all_gather_pieces(local, sizes, group, axis="shard"),
    }
    if not torch.equal(ways["collective"](), ways["funcshard"]()):
        raise AssertionError("the two gathers differ")
    wall = {k: [] for k in ways}
    cpu = {k: [] for k in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            fn()
            dist.barrier()  # the peer's part of the exchange is in this rank's wall time
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return {
        name: (statistics.median(wall[name]) * 1e3, statistics.median(cpu[name]) * 1e3)
        for name in ways
    } | {"numel": sum(sizes) * dist.get_world_size()}


def main(argv: list[str]) -> None:
    del argv
    results = fs.launch(_worker, FLAGS.d_model, FLAGS.repeats, nproc=FLAGS.nproc)
    numel = results[0]["numel"]
    print(
        f"one block's gather: {numel / 1e6:.2f}M fp32 params over {FLAGS.nproc} gloo ranks, "
        f"median of {FLAGS.repeats}"
    )
    print(f"{'rank':>4} {'way':>10} {'wall ms':>8} {'cpu ms':>7}")
    for rank, r in enumerate(results):
        for name in ("collective", "funcshard"):
            wall, cpu = r[name]
            print(f"{rank:>4} {name:>10} {wall:8.2f} {cpu:7.2f}")
        fs_wall, fs_cpu = r["funcshard"]
        c_wall, c_cpu = r["collective"]
        print(f"{rank:>4} {'ratio':>10} {fs_wall / c_wall:8.2f} {fs_cpu / c_cpu:7.2f}")


if __name__ == "__main__":
    app.run(main)

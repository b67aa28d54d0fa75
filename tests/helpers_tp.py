"""Tensor-parallel models and their recipe, shared by the tensor-parallel tests.

A Llama-like model (embedding, attention with its heads split colwise / rowwise, a SwiGLU MLP
of uneven width, RMSNorm) parallelized with torch's own ``parallelize_module`` plan, as
torchtitan plans Llama; the reference is the same model, plain, in one process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import funcshard as fs

VOCAB, DIM, HEADS, HIDDEN, SEQ = 32, 20, 4, 44, 8  # local rows 11 at T=4: uneven over "shard"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the local heads of a colwise-sharded projection (torchtitan's view)
        q, k, v = (
            p(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h)).float()


def make_model(seed: int = 0, layers: int = 2) -> Llama:
    torch.manual_seed(seed)
    return Llama(layers)


LAYER_PLAN = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.w1": ColwiseParallel(),
    "mlp.w3": ColwiseParallel(),
    "mlp.w2": RowwiseParallel(),
}


# torchtitan's Llama plan with sequence parallelism: the norms run on sequence shards (their
# weights replicated, their gradients partial until torch reduces them), the embedding rowwise
SP_LAYER_PLAN = {
    "attn_norm": SequenceParallel(),
    "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(output_layouts=Shard(1)),
    "mlp_norm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.w1": ColwiseParallel(),
    "mlp.w3": ColwiseParallel(),
    "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
}


def model_plan(*, sequence_parallel: bool = False) -> dict:
    """torchtitan's Llama plan for the whole model (``parallelize_module``'s dict plan, the
    layers by wildcard): with ``sequence_parallel``, its norms on sequence shards and the
    embedding rowwise; else attention heads and MLP colwise / rowwise only; the head colwise,
    its logits gathered."""
    if not sequence_parallel:
        layers = {f"layers.*.{k}": v for k, v in LAYER_PLAN.items()}
        return layers | {"head": ColwiseParallel(output_layouts=Replicate())}
    layers = {f"layers.*.{k}": v for k, v in SP_LAYER_PLAN.items()}
    return layers | {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def parallelize(model: Llama, mesh, *, sequence_parallel: bool = False) -> Llama:
    """``model`` tensor-parallel on ``mesh["tensor"]``, in place, by :func:`model_plan`."""
    parallelize_module(model, mesh["tensor"], model_plan(sequence_parallel=sequence_parallel))
    return model


# A model whose weights are big enough for 8-bit moments (>= 4096 elements), with rowwise
# (Shard(1)) weights whose local rows the global row's 8-bit block does not divide: ``down``'s
# row of 384 is cut in blocks of 128, its local row at T=2 (192) is not a multiple of 128; and
# ``odd``'s row of 195 splits unevenly at T=2 (98, 97) and T=4 (49, 49, 49, 48).
WIDE, ODD = 384, 195


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.up = nn.Linear(64, WIDE, bias=False)
        self.down = nn.Linear(WIDE, 64, bias=False)
        self.gate = nn.Linear(64, ODD, bias=False)
        self.odd = nn.Linear(ODD, 64, bias=False)
        self.head = nn.Linear(64, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(nn.functional.silu(self.up(h))) + self.odd(torch.tanh(self.gate(h)))
        return self.head(h).float()


def make_wide(seed: int = 0) -> Wide:
    """:class:`Wide`, its head's columns alternately 1x and 8x: the gradient rows of the
    rowwise weights (one per residual feature) alternate in magnitude, so an 8-bit block that
    crossed a row would code a small row with a large row's scale."""
    torch.manual_seed(seed)
    model = Wide()
    with torch.no_grad():
        model.head.weight[:, 1::2] *= 8.0
    return model


WIDE_PLAN = {
    "up": ColwiseParallel(),
    "down": RowwiseParallel(),
    # torch's colwise -> rowwise pair cannot run an uneven split; the rowwise layer splits
    # its replicated input itself instead (gate stays replicated)
    "odd": RowwiseParallel(input_layouts=Replicate()),
}


def parallelize_wide(model: Wide, mesh) -> Wide:
    """``model`` tensor-parallel on ``mesh["tensor"]``: up colwise, down / odd rowwise."""
    parallelize_module(model, mesh["tensor"], WIDE_PLAN)
    return model


class Uneven(nn.Module):
    """An MLP whose tensor split is uneven at T=2: 9 hidden rows, 5 and 4 a tensor rank, so
    every split leaf is larger on tensor rank 0 than on rank 1, and ``mix`` (replicated over
    "tensor") lies between the two in size."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)
        self.up = nn.Linear(8, 9)
        self.down = nn.Linear(9, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.relu(self.up(torch.tanh(self.mix(x)))))


def make_uneven(seed: int = 0) -> Uneven:
    torch.manual_seed(seed)
    return Uneven()


def parallelize_uneven(model: Uneven, mesh) -> Uneven:
    """``up`` colwise, ``down`` rowwise (its bias replicated), ``mix`` left plain."""
    parallelize_module(model, mesh["tensor"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def global_batch(step: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(2000 + step)
    return {
        "x": torch.randint(0, VOCAB, (rows, SEQ), generator=g),
        "y": torch.randint(0, VOCAB, (rows, SEQ), generator=g),
    }


def dp_coords(mesh) -> tuple[int, int]:
    """This rank's data-parallel index and size (tensor ranks share a batch)."""
    names = mesh.mesh_dim_names
    r = mesh.get_local_rank("replicate") if "replicate" in names else 0
    s = mesh.get_local_rank("shard")
    size_s = mesh.size(names.index("shard"))
    size_r = mesh.size(names.index("replicate"))
    return r * size_s + s, size_r * size_s


def local_batch(batch: dict, mesh) -> dict:
    index, size = dp_coords(mesh)
    return {k: v.chunk(size)[index] for k, v in batch.items()}


def make_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["x"],))
        if hasattr(logits, "full_tensor"):  # a DTensor output (sharded head)
            logits = logits.full_tensor()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))

    return loss_fn


def train(state, model, mesh, steps, *, rows: int, microbatches: int = 1):
    loss_fn = make_loss_fn(model)
    history = []
    for step in steps:
        batch = local_batch(global_batch(step, rows), mesh)
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=microbatches)
        history.append(metrics)
    return state, history


def reference_run(model: nn.Module, make_opt, steps: int, rows: int, *, clip=None) -> dict:
    """The plain model in one process on the concatenated global batch."""
    model = copy.deepcopy(model)
    opt = make_opt(model)
    losses, norms = [], []
    for step in range(steps):
        batch = global_batch(step, rows)
        logits = model(batch["x"])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["y"].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        norms.append(float(norm))
        opt.step()
        losses.append(loss.item())
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "losses": losses,
        "norms": norms,
    }


def world_mesh(shard: int, replicate: int, tensor: int):
    assert shard * replicate * tensor == dist.get_world_size()
    return fs.make_mesh(shard=shard, replicate=replicate, tensor=tensor, device_type="cpu")

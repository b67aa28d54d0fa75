"""A tiny causal transformer whose positions come from the batch (or from a RoPE buffer), and
its reference run in one process on full sequences, for the context-parallel tests."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import funcshard as fs

VOCAB, DIM, HEADS, LAYERS, MAX_LEN = 32, 16, 4, 2, 64


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, rope: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.rope = rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, L, D))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, rope: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, rope)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Rope(nn.Module):
    """Rotary tables for ``MAX_LEN`` positions in one non-persistent buffer (L, 2, half)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        half = head_dim // 2
        freqs = 1.0 / (100.0 ** (torch.arange(half) / half))
        angles = torch.arange(MAX_LEN)[:, None] * freqs[None]
        table = torch.stack([angles.cos(), angles.sin()], 1)
        self.register_buffer("table", table, persistent=False)


class TinyGPT(nn.Module):
    """Causal; positions from ``positions`` (a learned table) or, ``rope=True``, from the rotary
    buffer ``rope.table`` (its rows taken in order: what context parallel splits)."""

    def __init__(self, heads: int = HEADS, rope: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = None if rope else nn.Embedding(MAX_LEN, DIM)
        self.layers = nn.ModuleList(Layer(DIM, heads, rope) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.rope = Rope(DIM // heads) if rope else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        cos = sin = None
        if self.rope is not None:
            # (L, 2, half): the rows of this rank's positions under context parallel
            table = self.rope.table[: tokens.shape[1]]
            cos, sin = table[:, 0], table[:, 1]
        else:
            x = x + self.pos(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def make_model(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw)


def global_batch(step: int, rows: int, length: int) -> dict:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (rows, length + 1), generator=g)
    positions = torch.arange(length).expand(rows, length).contiguous()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "positions": positions}


SEQ_DIMS = {"tokens": 1, "labels": 1, "positions": 1}


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def make_loss_fn(model: nn.Module):
    def loss_fn(params, batch):
        logits = fs.functional_call(model, params, (batch["tokens"], batch["positions"]))
        return loss_of(logits, batch["labels"])

    return loss_fn


def train(state, model, steps: int, rows: int, length: int, groups: int, mb: int = 2, loss_fn=None):
    """``fs.train_step`` on this data-parallel group's rows of each step's global batch (the
    ranks of a context group pass the same rows: ``groups`` = R x S data-parallel groups of
    ``dist.get_world_size() / groups`` consecutive ranks)."""
    group = dist.get_rank() // (dist.get_world_size() // groups)
    loss_fn = loss_fn or make_loss_fn(model)
    history = []
    for step in range(steps):
        batch = {k: v.chunk(groups)[group] for k, v in global_batch(step, rows, length).items()}
        state, metrics = fs.train_step(state, batch, loss_fn, microbatches=mb)
        history.append(metrics)
    return state, history


def reference_run(model: nn.Module, steps: int, rows: int, length: int, call=None) -> dict:
    """One process, plain torch SGD (momentum 0.9) on the global batch of full sequences
    (``call(model, batch)``: the logits; default ``model(tokens, positions)``)."""
    model = copy.deepcopy(model)
    call = call or (lambda m, b: m(b["tokens"], b["positions"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for step in range(steps):
        batch = global_batch(step, rows, length)
        loss = loss_of(call(model, batch), batch["labels"])
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        opt.step()
        losses.append(loss.item())
    return {"params": dict(model.named_parameters()), "losses": losses, "norms": norms}


def _part(t: torch.Tensor, chunks, rank: int) -> torch.Tensor:
    size = t.shape[2] // chunks.count
    return torch.cat([t.narrow(2, c * size, size) for c in chunks.of(rank)], 2)


class _Counting:
    """A ring block kernel that counts the attention FLOPs of its forward calls."""

    def __init__(self, kernel) -> None:
        from funcshard.parallel import ring as ring_lib

        self.total = 0
        self.kernel = ring_lib.Kernel("counting", self.forward, kernel.backward)
        self.inner = kernel

    def forward(self, q, k, v, causal, scale):
        n, m = q.shape[-2], k.shape[-2]
        pairs = n * (n + 1) // 2 if causal else n * m
        self.total += 4 * q.shape[0] * q.shape[1] * q.shape[-1] * pairs
        return self.inner.forward(q, k, v, causal, scale)


def _ring_case(q, k, v, grad, chunks, causal: bool, kernel) -> dict:
    from funcshard.parallel import ring as ring_lib

    me = dist.get_rank()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    ref.backward(grad)
    mine = [_part(t, chunks, me).float().requires_grad_() for t in (q, k, v)]
    saved, counting = [], _Counting(kernel)

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kw = {"chunks": chunks, "group": dist.group.WORLD, "kernel": counting.kernel}
        y = ring_lib.ring(*mine, is_causal=causal, **kw)
    y.backward(_part(grad, chunks, me).float())
    pairs = [(y, ref)] + [(a.grad, b.grad) for a, b in zip(mine, full, strict=True)]
    return {
        "error": max((a.double() - _part(b, chunks, me)).abs().max().item() for a, b in pairs),
        "saved": (sum(saved), 4 * y.numel() * 4 + y[..., 0].numel() * 4),
        "flops": (counting.total, ring_lib.flops(chunks, me, causal, tuple(mine[0].shape))),
    }


def ring_worker() -> dict:
    """The flash ring on its own at C=2 (one rank's (1, 2, 8, 8) of a 16-token sequence):
    its output and gradients against SDPA on the whole sequence in fp64, for both kernels,
    causal or not, load balanced or not; the bytes its node keeps for the backward; and the
    attention FLOPs each rank's kernel calls did (counted in the kernel), against
    ``ring.flops``."""
    from funcshard.parallel import ring as ring_lib
    from funcshard.parallel.attention import Chunks

    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    out = {}
    for balanced in (True, False):
        for causal in (True, False):
            for kernel in (ring_lib.CPU_KERNEL, ring_lib.MATH_KERNEL):
                key = f"{kernel.name}/causal={causal}/balanced={balanced}"
                out[key] = _ring_case(*tensors, Chunks(2, balanced), causal, kernel)
    out["saved"] = _saved_against_the_plan([t.float() for t in tensors[:3]], Chunks(2, True))
    return out


def _saved_against_the_plan(qkv: list[torch.Tensor], chunks) -> dict:
    """What each algorithm's attention keeps for the backward (fp32, this rank's part of a
    (1, 2, 16, 8) q, k, v), against ``fs.plan``'s ``memory.attention``."""
    from funcshard.parallel import attention

    me, out = dist.get_rank(), {}
    for name in ("ring", "all_to_all"):
        mine = [_part(t, chunks, me).requires_grad_() for t in qkv]
        saved: list[int] = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = getattr(attention, name)(
                *mine, chunks=chunks, group=dist.group.WORLD, is_causal=True
            )
        y.sum().backward()
        plan = fs.plan(
            {"w": (4, 4)}, world_size=2, context=2, seq_len=16, batch_size=1,
            attention=(1, 2, 8), context_algorithm=name,
        )  # fmt: skip
        out[name] = (sum(saved), plan.memory.attention)
    return out


def run(context: int, algorithm: str, *, replicate: int = 1, shard: int = 1, **init_kw):
    """3 steps of 2 microbatches of the tiny GPT at ``context``: ``(state, history, ref)``,
    the reference one process in fp32 on the full sequences."""
    mesh = fs.make_mesh(context=context, replicate=replicate, shard=shard, device_type="cpu")
    model, plain = make_model(0), make_model(0)
    cp = fs.ContextParallel(seq_dims=SEQ_DIMS, algorithm=algorithm)
    opt = fs.optim.sgd(0.1, momentum=0.9)
    init_kw.setdefault("strategy", "optim_grads_params")
    state = fs.init(model, opt, mesh=mesh, context=cp, **init_kw)
    groups = dist.get_world_size() // context
    state, history = train(state, model, 3, 8, 16, groups)
    return state, history, reference_run(plain, 3, 8, 16)


def compose_worker_2(directory: str) -> dict:
    """C=2 on 2 ranks: a bf16 compute policy (both algorithms), offload, and a checkpoint of
    the ring's state saved under context (its full params returned for the C=1 restore)."""
    import models

    out = {}
    bf16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for algorithm in ("ring", "all_to_all"):
        out[f"bf16/{algorithm}"] = models.parity_errors(*run(2, algorithm, policy=bf16))
    state, history, ref = run(2, "ring", offload_fraction=0.5)
    out["offload/ring"] = models.parity_errors(state, history, ref)
    fs.save(directory, state)
    out["full"] = {k: v.clone() for k, v in fs.full_params(state).items()}
    return out


def restore_worker_1(directory: str) -> dict:
    """The context run's checkpoint restored on one rank without context parallel."""
    mesh = fs.make_mesh(device_type="cpu")
    like = fs.init(make_model(1), fs.optim.sgd(0.1, momentum=0.9), mesh=mesh)
    state = fs.restore(directory, like=like)
    return {k: v.clone() for k, v in fs.full_params(state).items()}


def compose_worker_4() -> dict:
    """4 ranks: HFSDP (R2 x C2, outer_strategy="optim") for both algorithms, and
    deterministic=True's params bitwise alike on R2 x C2 and S2 x C2 (the same C)."""
    import models

    out = {}
    for algorithm in ("ring", "all_to_all"):
        result = run(2, algorithm, replicate=2, outer_strategy="optim")
        out[f"hfsdp/{algorithm}"] = models.parity_errors(*result)
    full = {}
    for layout, kw in (("R2C2", {"replicate": 2}), ("S2C2", {"shard": 2})):
        state, history, ref = run(2, "ring", deterministic=True, **kw)
        out[f"deterministic/{layout}"] = models.parity_errors(state, history, ref)
        full[layout] = fs.full_params(state)
    out["bitwise"] = all(torch.equal(full["R2C2"][k], full["S2C2"][k]) for k in full["R2C2"])
    return out


def tensor_worker() -> dict:
    """context=2 x tensor=2 on 4 ranks: the tests' tensor-parallel Llama (heads colwise, 2 of
    4 a tensor rank; causal, no positions) against one process, both algorithms."""
    import helpers_tp as tp
    import models

    out = {}
    for algorithm in ("ring", "all_to_all"):
        mesh = fs.make_mesh(context=2, tensor=2, device_type="cpu")
        model = tp.parallelize(tp.make_model(0), mesh)
        cp = fs.ContextParallel(seq_dims={"tokens": 1, "labels": 1}, algorithm=algorithm)
        state = fs.init(model, fs.optim.sgd(0.1, momentum=0.9), mesh=mesh, context=cp)

        def loss_fn(params, batch, model=model):
            logits = fs.functional_call(model, params, (batch["tokens"],))
            return loss_of(logits, batch["labels"])

        state, history = train(state, model, 3, 4, 16, 1, loss_fn=loss_fn)
        ref = reference_run(tp.make_model(0), 3, 4, 16, call=lambda m, b: m(b["tokens"]))
        out[algorithm] = models.parity_errors(state, history, ref)
    return out

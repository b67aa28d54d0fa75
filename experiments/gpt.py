"""A small GPT: pre-LN transformer blocks in ``blocks`` (funcshard's default gather units)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = ["GPT", "GPTConfig", "GroupedExperts", "MoE", "tensor_plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig:
    """Model size. ``tied`` shares the token embedding with the output head."""

    vocab: int = 32
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mlp_ratio: int = 4
    tied: bool = True
    experts: int = 0  # > 0: each block's MLP is a mixture of that many experts (MoE)
    top_k: int = 2  # experts per token

    def __post_init__(self) -> None:
        for field in ("vocab", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"GPTConfig: top_k ({self.top_k}) must lie in [1, experts]")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )


class GroupedExperts(nn.Module):
    """``num_experts`` MLPs stacked on dim 0 (torchtitan's convention, what
    ``fs.ExpertParallel`` shards): ``forward(x, num_tokens_per_expert)``, rows sorted by expert.
    A loop over the experts: ``torch._grouped_mm`` does not run on the CPU."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2))
        pieces = torch.split(x, counts.tolist())
        return torch.cat([F.gelu(p @ w1[e]) @ w2[e] for e, p in enumerate(pieces)])


class MoE(nn.Module):
    """Top-k routed experts: a linear router, a per-expert bias that steers only the choice
    (DeepSeek-V3's auxiliary-loss-free balancing: the loop nudges ``router_bias`` against the
    step's global load, :func:`expert_load` handed back as ``fs.summed`` and
    :func:`balance_routers`), gate weights from the unbiased softmax, tokens sorted by expert."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = GroupedExperts(cfg.experts, cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.register_buffer("router_bias", torch.zeros(cfg.experts))
        self.last_load = torch.zeros(cfg.experts, dtype=torch.int64)  # this rank's, last call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = self.router(x).softmax(dim=-1)
        _, chosen = (scores.detach() + self.router_bias).topk(self.top_k, dim=-1)
        gates = scores.gather(1, chosen)  # (tokens, top_k)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=scores.shape[1])
        self.last_load = counts.detach().cpu()
        out = self.experts(x[order // self.top_k], counts)
        routed = torch.empty_like(out).index_copy(0, order, out).view(-1, self.top_k, shape[-1])
        return (routed * gates.unsqueeze(-1)).sum(1).reshape(shape)


def expert_load(model: nn.Module) -> torch.Tensor:
    """Tokens per expert of the model's last forward, a row per MoE block ``(blocks, experts)``:
    this rank's microbatch only. A ``loss_fn`` returns it as ``fs.summed(expert_load(model))``
    in its aux, so that ``metrics["aux"]`` holds the step's load over every microbatch and
    data-parallel rank."""
    return torch.stack([m.last_load for m in model.modules() if isinstance(m, MoE)])


@torch.no_grad()
def balance_routers(model: nn.Module, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free update from the step's GLOBAL ``load`` (the summed
    :func:`expert_load`): each block's ``router_bias`` rises by ``rate`` for the experts below
    that block's mean load and falls by ``rate`` for those above. Every rank applies the same
    update from the same total, so the buffers stay equal across ranks."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe, row in zip(moes, load, strict=True):
        row = row.to(moe.router_bias.device, torch.float32)
        moe.router_bias.add_(rate * torch.sign(row.mean() - row))


class Block(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x)) (or a mixture of experts)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg) if cfg.experts else None
        if self.moe is None:
            self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
            self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        # heads of head_dim each: a tensor-parallel block holds its own share of them
        q, k, v = (rearrange(p(h), "b t (h d) -> b h t d", d=self.head_dim) for p in self.qkv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(y, "b h t d -> b t (h d)"))
        if self.moe is not None:
            return x + self.moe(self.ln2(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    @property
    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q, self.k, self.v


def tensor_plan() -> dict:
    """Each block's tensor-parallel plan (torchtitan's Llama plan, for ``parallelize_module``
    on ``mesh["tensor"]``): attention heads and the MLP's hidden units split colwise into,
    rowwise out of, each block; embeddings, norms and the head stay replicated."""
    # DTensor's import (most of a second) only in a run with a tensor axis
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc": ColwiseParallel(),
        "out": RowwiseParallel(),
    }


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layer`` blocks, final LayerNorm, linear head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = None if cfg.tied else nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: scale the residual projections by depth
            projs = (block.proj,) if block.moe is not None else (block.proj, block.out)
            for proj in projs:
                nn.init.normal_(proj.weight, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab) for int64 ``tokens`` (batch, time); ``positions``: each
        token's place in its sequence (context parallel: this rank's part), else 0..time-1.

        A pipeline stage (``fs.pipeline.split``: the modules outside the stage are
        ``nn.Identity``, or None in stages built by hand) runs only what it holds, torchtitan's
        way: without the token embedding it takes the previous stage's hidden states (batch,
        time, d_model) as ``tokens``; without the final norm and head it returns its hidden
        states.

        Raises:
          ValueError: a sequence longer than ``seq_len``; a tied model's stage that holds the
            head (the final norm) but not the token embedding its weight is tied to (a tied
            head split from its embedding would train two copies: build ``tied=False``).
        """
        T = tokens.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence of {T} tokens exceeds seq_len={self.cfg.seq_len}")
        if positions is None:
            positions = torch.arange(T, device=tokens.device)
        x = self.tok_emb(tokens) if _held(self.tok_emb) else tokens
        if _held(self.pos_emb):
            x = x + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        if self.cfg.tied and _held(self.ln_f) and not _held(self.tok_emb):
            raise ValueError(
                "GPT: this pipeline stage holds the final norm and the output head, but not "
                "tok_emb, whose weight the head is tied to (GPTConfig(tied=True)); a tied head "
                "cannot be split from its embedding: build the model with tied=False "
                "(experiments/train.py --notied)"
            )
        if _held(self.ln_f):
            x = self.ln_f(x)
        if not self.cfg.tied:
            return self.head(x) if _held(self.head) else x
        return F.linear(x, self.tok_emb.weight) if _held(self.ln_f) else x  # tied: with ln_f


def _held(module: nn.Module | None) -> bool:
    """Whether a pipeline stage holds ``module``: ``fs.pipeline.split`` replaces a removed
    module by ``nn.Identity``, a stage built by hand may set it to None."""
    return module is not None and not isinstance(module, nn.Identity)

"""A small GPT: pre-LN transformer blocks in ``blocks`` (funcshard's default gather units)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["GPT", "GPTConfig", "tensor_plan"]


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

    def __post_init__(self) -> None:
        for field in ("vocab", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )


class Block(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        # heads of head_dim each: a tensor-parallel block holds its own share of them
        q, k, v = (rearrange(p(h), "b t (h d) -> b h t d", d=self.head_dim) for p in self.qkv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(y, "b h t d -> b t (h d)"))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    @property
    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q, self.k, self.v


def tensor_plan() -> dict:
    """Each block's tensor-parallel plan (torchtitan's Llama plan, for ``parallelize_module``
    on ``mesh["tensor"]``): attention heads and the MLP's hidden units split colwise into,
    rowwise out of, each block; embeddings, norms and the head stay replicated."""
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
            for proj in (block.proj, block.out):
                nn.init.normal_(proj.weight, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for int64 ``tokens`` (batch, time)."""
        T = tokens.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence of {T} tokens exceeds seq_len={self.cfg.seq_len}")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.head is None:
            return F.linear(x, self.tok_emb.weight)
        return self.head(x)

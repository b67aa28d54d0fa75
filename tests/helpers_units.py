"""Tiny transformers models for the gather-unit tests (activation checkpointing per layer):
shared by ``test_units.py`` and ``test_compile.py``."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB, SEQ = 37, 7


def hf_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="eager",
        )
        model = transformers.GPT2LMHeadModel(config)
    return model.float().train()


def token_batch(step: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(step))


def ce(model: nn.Module, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    del model
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

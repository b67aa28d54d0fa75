"""Tiny real transformers models (Llama, GPT-2) that the Hugging Face tests share.

Used by ``test_hf.py`` (safetensors in and out) and ``test_cli.py`` (the command line's
conversions read back by ``from_pretrained``).
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 101  # uneven over 2 and 3 ranks


def make_hf(kind: str, seed: int = 0, meta: bool = False) -> torch.nn.Module:
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3moe":  # experts stacked in memory, one tensor per expert in its files
        config = transformers.Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4
        )  # lm_head tied to wte
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config).eval()

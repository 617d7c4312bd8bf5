"""A tiny HuggingFace ``LlamaForCausalLM`` as an autoshard model file (captured through torch.export)."""

import torch
import transformers

CONFIGS = {"tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)}  # fmt: skip


def build(config: str = "tiny"):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIGS[config]))


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config]["vocab_size"], (batch, seq)),)

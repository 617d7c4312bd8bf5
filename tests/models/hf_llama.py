"""A tiny HuggingFace ``LlamaForCausalLM`` as an autoshard model file (captured through torch.export)."""

import torch
import transformers

CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # Llama-3.1-70B's config.json (planning and checks at scale only, on the meta device)
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072),
}  # fmt: skip


def build(config: str = "tiny"):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIGS[config]))


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config]["vocab_size"], (batch, seq)),)

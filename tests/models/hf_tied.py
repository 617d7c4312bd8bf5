"""A tiny transformers ``LlamaForCausalLM`` whose output head is its token embedding
(``tie_word_embeddings=True``, as small Llama, Qwen and Gemma models ship): one parameter read
twice, at the first layer and after the last."""

import torch
import transformers

CONFIGS = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # four layers: two per chunk under pp=2 with two virtual stages
    "tiny4": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip


def build(config: str = "tiny"):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIGS[config]))


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config]["vocab_size"], (batch, seq)),)

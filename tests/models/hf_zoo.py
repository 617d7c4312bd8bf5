"""transformers' decoder architectures at tiny configs, as one autoshard model file: the config
name is the architecture (``--config qwen3``). Each is built as the library builds it, with the
features that make it itself (tied embeddings, per-head q/k norms, fused QKV projections,
soft-capping, non-affine norms); only the sizes are shrunk."""

import torch
import transformers

# 64 wide, 4 heads of 16 (2 kv heads where the architecture groups them), 2 layers: every axis
# the matrix splits (TP2, PP2, CP2) divides it
_DECODER = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
_GEMMA = dict(_DECODER, head_dim=16, query_pre_attn_scalar=16, sliding_window=256)

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_DECODER, sliding_window=None)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_DECODER, head_dim=16)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", _GEMMA),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", _GEMMA),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_DECODER, pad_token_id=0)),
    # GPT-2's dropout off: verification compares against one device, whose dropout masks differ
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                   n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_DECODER, rotary_pct=0.25)),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", _DECODER),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", _DECODER),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                   n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, new_decoder_architecture=False,
                                                       multi_query=True, ffn_hidden_size=128,
                                                       max_position_embeddings=256)),
    # ALiBi: an additive bias of slope_h * key position on the scores, no position embedding
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4,
                                                     hidden_dropout=0.0, attention_dropout=0.0)),
    # Cohere: per-head q/k LayerNorms whose weight is (heads, head_dim), parallel attention and MLP
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(_DECODER, use_qk_norm=True)),
}  # fmt: skip
# an architecture with a feature switched on that its matrix config leaves off
VARIANTS = {
    # a sliding window shorter than the traced sequence (32 tokens): a banded mask, not a causal one
    "mistral-swa": ("MistralForCausalLM", "MistralConfig", dict(_DECODER, sliding_window=16)),
    # 8 query heads, 2 key/value heads: at TP4 each key/value head is shared by 2 ranks
    "llama-kv2": ("LlamaForCausalLM", "LlamaConfig", dict(_DECODER, num_attention_heads=8)),
}
# released models' config.json at full size, for planning and checks at scale on the meta device
# (not in the matrix, which runs every architecture on CPU processes)
FULL_SIZE = {
    # Command R+ (its config.json)
    "cohere-plus": ("CohereForCausalLM", "CohereConfig", dict(
        vocab_size=256000, hidden_size=12288, intermediate_size=33792, num_hidden_layers=64,
        num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=8192, use_qk_norm=True,
        tie_word_embeddings=True, logit_scale=0.8333333333333334, rope_theta=75000000.0)),
    "qwen3-32b": ("Qwen3ForCausalLM", "Qwen3Config", dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                                                         num_hidden_layers=64, num_attention_heads=64,
                                                         num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                                         max_position_embeddings=131072)),
    "mistral-7b": ("MistralForCausalLM", "MistralConfig", dict(vocab_size=32768, hidden_size=4096,
                                                              intermediate_size=14336, num_hidden_layers=32,
                                                              num_attention_heads=32, num_key_value_heads=8,
                                                              head_dim=128, rope_theta=1e6, sliding_window=None,
                                                              max_position_embeddings=131072)),
}  # fmt: skip
_SPECS = {**ARCHITECTURES, **VARIANTS, **FULL_SIZE}
CONFIGS = {name: spec[2] for name, spec in _SPECS.items()}

# the architecture matrix (benchmarks/architectures.py runs all of it, tests/test_architectures.py
# the CI subset): layout name -> (gpus, --force pins)
LAYOUTS = {
    "tp2-sp": (2, "tp=2,sp=on"),
    "pp2": (2, "pp=2,schedule=1f1b"),
    "dp2": (2, "dp=2,zero=1"),
    "cp2": (2, "cp=2,attention=ring"),
    "tp2-pp2": (4, "tp=2,pp=2,sp=on,schedule=1f1b"),
    "tp4": (4, "tp=4,sp=on"),  # more ranks than the tiny configs' 2 key/value heads: each shared by 2
}
# one case per feature that needed its own rule: per-head norms, a partial-sum norm with a padding
# row, unequal fused-QKV slices, Conv1D rows with tied weights, tied weights across stages with
# soft-capping, a scaled tied embedding under ZeRO, a causal mask tensor under CP, fused-QKV chunks,
# a sliding window shorter than the sequence under CP, ALiBi (its bias recognised while captured on meta;
# under TP cut to each rank's heads, which its attention merges with the batch),
# a (heads, head_dim) norm weight, key/value heads shared by TP ranks
CI_SUBSET = [
    ("qwen3", "tp2-sp"),
    ("olmo2", "tp2-sp"),
    ("phi3", "tp2-sp"),
    ("gpt2", "tp2-sp"),
    ("gemma2", "pp2"),
    ("gemma3", "dp2"),
    ("llama", "cp2"),
    ("gpt_neox", "tp2-pp2"),
    ("mistral-swa", "cp2"),
    ("bloom", "tp2-sp"),
    ("cohere", "tp2-sp"),  # a per-head norm weight of shape (heads, head_dim), read through a cast
    ("llama-kv2", "tp4"),  # 2 key/value heads over 4 TP ranks
]


def build(config: str = "llama"):
    model_class, config_class, kwargs = _SPECS[config]
    kwargs = {k: v for k, v in kwargs.items() if k != "num_key_value_heads" or config != "gpt_neox"}
    cfg = getattr(transformers, config_class)(**kwargs)
    return getattr(transformers, model_class)(cfg)


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, 128, (batch, seq)),)


# models of the matrix written by hand in a file of their own, not transformers' classes:
# name -> (file, --config)
FILES = {"nanogpt": ("tests/models/nanogpt.py", "tiny")}

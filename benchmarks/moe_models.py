"""The models of benchmarks/moe.py, as one autoshard model file (``build``, ``sample_inputs``).

``--config deepseek``: the bundled examples/deepseek_v3.py (fixed-capacity ``[E, C, H]`` buffers and
bmm, capacity factor 1.25) made wider than its ``tiny`` config, so that the experts' matmuls are
not negligible against the all-to-all on CPU processes. ``--config mixtral``: transformers'
``MixtralForCausalLM`` at the same width, its default experts (grouped GEMMs over rows sorted by
expert, dropless). Both have 8 experts of top-2, so EP2 and EP4 divide them.
"""

import dataclasses
import importlib.util
from fractions import Fraction
from pathlib import Path

import torch

HIDDEN, EXPERT_FFN, EXPERTS, TOP_K, VOCAB = 512, 1024, 8, 2, 1024


def _example():
    """examples/deepseek_v3.py as a module (examples/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "deepseek_v3.py"
    spec = importlib.util.spec_from_file_location("deepseek_v3_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _deepseek():
    example = _example()
    cfg = dataclasses.replace(
        example.CONFIGS["tiny"], hidden=HIDDEN, dense_ffn=2 * EXPERT_FFN, vocab=VOCAB, heads=8, q_rank=256,
        kv_rank=128, qk_nope_dim=32, qk_rope_dim=16, v_dim=32, experts=EXPERTS, expert_ffn=EXPERT_FFN,
        top_k=TOP_K, groups=1, top_groups=1, capacity_factor=Fraction(5, 4),
    )  # fmt: skip
    return example.DeepSeekV3(cfg)


def _mixtral():
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=1024,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


CONFIGS = {"deepseek": _deepseek, "mixtral": _mixtral}


def build(config: str = "deepseek"):
    return CONFIGS[config]()


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, VOCAB, (batch, seq)),)

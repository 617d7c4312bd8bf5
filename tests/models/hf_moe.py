"""transformers' mixture-of-experts decoders, as one autoshard model file.

``--config deepseek_v3 | deepseek_v2 | mixtral | qwen3_moe | llama4`` are tiny configs (CPU tests); a suffix picks the
experts implementation transformers runs them with (``-eager``: a loop over expert ids,
``-batched``: per-token gathered weights; none: its default, grouped GEMMs). ``deepseek_v3-671b``
and ``mixtral-8x22b`` are the published configurations (planning only, on the meta device).
"""

import torch
import transformers

# 64 wide, 4 heads, 2 layers (DeepSeek-V3's first dense), 8 or 4 experts of top-2: EP2 and EP4 divide them
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)  # fmt: skip

ARCHITECTURES = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        _TINY, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # DeepSeek-V2: multi-head latent attention with complex-number rotary embeddings, greedy routing
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        _TINY, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        _TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        _TINY, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2)),
    # Llama 4's text model: batched experts, a shared expert, complex-number rotary embeddings, and
    # its input moved with input_ids.to(device), which the loss must see through
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig", dict(
        _TINY, intermediate_size_mlp=128, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=1, attn_temperature_tuning=False, use_qk_norm=True)),
    # DeepSeek-V3 (arXiv 2412.19437, its config.json) and Mixtral 8x22B (its config.json)
    "deepseek_v3-671b": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128)),
    "mixtral-8x22b": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=65536, rope_theta=1e6)),
}  # fmt: skip
IMPLEMENTATIONS = {"eager": "eager", "batched": "batched_mm"}


def _parse(config: str) -> tuple[str, str | None]:
    name, _, impl = config.partition("-")
    if name in ARCHITECTURES and impl in IMPLEMENTATIONS:
        return name, IMPLEMENTATIONS[impl]
    return config, None


def build(config: str = "deepseek_v3"):
    name, impl = _parse(config)
    model_class, config_class, kwargs = ARCHITECTURES[name]
    cfg = getattr(transformers, config_class)(**kwargs)
    if impl is not None:
        cfg._experts_implementation = impl
    return getattr(transformers, model_class)(cfg)


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    name, _ = _parse(config)
    return (torch.randint(0, ARCHITECTURES[name][2]["vocab_size"], (batch, seq)),)


# the MoE equivalence matrix (benchmarks/architectures.py --moe runs all of it, tests/test_moe_matrix.py
# the CI subset): the bundled example (its fixed-capacity buffer form), transformers' grouped and
# batched experts, and loops over expert modules; layout name -> (gpus, --force pins). EP folds
# into the stage's tp x cp x dp ranks.
MODELS = {
    "deepseek_v3 (example)": ("examples/deepseek_v3.py", "tiny"),
    "deepseek_v3": ("tests/models/hf_moe.py", "deepseek_v3"),
    "deepseek_v2": ("tests/models/hf_moe.py", "deepseek_v2"),
    "mixtral": ("tests/models/hf_moe.py", "mixtral"),
    "qwen3_moe": ("tests/models/hf_moe.py", "qwen3_moe"),
    "llama4": ("tests/models/hf_moe.py", "llama4"),
    # a loop over an nn.ModuleList of experts (where + index_put), grouped by canonicalisation
    "naive_moe (loop)": ("tests/models/naive_moe.py", "tiny"),
    # Mixtral's reference loop (one_hot mask, where, index_add_), traced by symbolic_trace
    "reference_moe (loop)": ("tests/models/reference_moe.py", "tiny"),
    # transformers' batched_mm experts (per-token gathered weights), grouped by canonicalisation
    "mixtral (batched)": ("tests/models/hf_moe.py", "mixtral-batched"),
}
LAYOUTS = {
    "ep2": (2, "ep=2,dp=2"),
    "ep4": (4, "ep=4,dp=4"),
    "ep2-pp2": (4, "ep=2,dp=2,pp=2,schedule=1f1b"),
    "ep2-tp2": (4, "ep=2,tp=2,dp=2,sp=off"),  # EP2 over the TP pair, TP2 on attention and dense layers
    "ep4-tp2dp2": (4, "ep=4,tp=2,dp=2,sp=off"),  # EP4 folded over TP2 x DP2
    # sequence parallel: each TP rank routes its slice of the sequence, no TP sharing of the rows
    "ep2-tp2-sp": (4, "ep=2,tp=2,dp=2,sp=on"),
    "ep4-tp2dp2-sp": (4, "ep=4,tp=2,dp=2,sp=on"),
    "ep2-zero1": (4, "ep=2,dp=4,zero=1"),
    "ep2-zero3": (4, "ep=2,dp=4,zero=3"),
    # recomputed MoE layers count their expert loads inside the checkpoint: their routing biases
    # must still be updated and saved
    "ep2-recompute": (2, "ep=2,dp=2,recompute=activation"),
    "ep2-pp2-dualpipev-recompute": (4, "ep=2,dp=2,pp=2,schedule=dualpipev,recompute=full"),
    # selective recomputation under a split backward; transformers' Mixtral computes batch * sequence
    # once for all its layers, which no stage may send
    "ep2-pp2-dualpipev-selective": (4, "ep=2,dp=2,pp=2,schedule=dualpipev,recompute=attention+activation"),
}
# every layout once, every model at least twice
CI_SUBSET = [
    ("deepseek_v3 (example)", "ep2-pp2"),
    ("deepseek_v3 (example)", "ep4-tp2dp2"),
    ("deepseek_v3 (example)", "ep2-zero3"),
    ("deepseek_v3", "ep2-tp2"),
    ("deepseek_v3", "ep4"),
    ("mixtral", "ep2-pp2-dualpipev-selective"),
    ("mixtral", "ep2-zero1"),
    ("deepseek_v3 (example)", "ep2-pp2-dualpipev-recompute"),
    ("deepseek_v3", "ep2-recompute"),
    ("llama4", "ep2-pp2"),  # the loss reads the token ids through the model's own .to(device)
    ("deepseek_v3 (example)", "ep4-tp2dp2-sp"),  # MLA and capacity buffers on sequence slices
    ("mixtral", "ep2-tp2-sp"),  # batch x sequence counted once for all layers: this rank's share
    ("naive_moe (loop)", "ep2-pp2"),  # each rank's rows of every expert's own parameters, exchanged
    ("reference_moe (loop)", "ep2-zero1"),
    ("mixtral (batched)", "ep2"),
    ("deepseek_v2", "ep2-tp2"),  # complex-number rotary embeddings split by heads
]

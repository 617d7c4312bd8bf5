"""The equivalence matrix of the bundled examples (GPT, LLaMA) and transformers' LlamaForCausalLM
(captured through torch.export): layout name -> (gpus, --force pins). ``python
benchmarks/architectures.py --examples`` runs all of it; ``tests/test_equivalence.py`` the CI
subset, each feature once."""

LAYOUTS = {
    "tp2": (2, "tp=2,sp=off"),
    "tp2-sp": (2, "tp=2,sp=on"),
    # selective recomputation skips the collectives whose outputs nothing it remakes needs
    "tp2-sp-selective": (2, "tp=2,sp=on,recompute=activation"),
    "pp2-1f1b": (2, "pp=2,schedule=1f1b"),
    "pp2-interleaved": (2, "pp=2,schedule=interleaved"),
    "pp2-zero-bubble": (2, "pp=2,schedule=zero-bubble"),
    "dp2-zero0": (2, "dp=2,zero=0"),
    "dp2-zero1": (2, "dp=2,zero=1"),
    "dp2-zero2": (2, "dp=2,zero=2"),
    "dp2-zero3": (2, "dp=2,zero=3"),
    "tp2-pp2-dp2": (8, "tp=2,pp=2,dp=2,zero=1"),
    "pp2-dp2-zero3": (4, "pp=2,dp=2,zero=3,schedule=interleaved"),
    "pp2-dp2-zero2-zb": (4, "pp=2,dp=2,zero=2,schedule=zero-bubble"),  # a split backward reduces in its weight pass
    # a split backward over checkpointed layers: the weight pass is one backward call (one recomputation)
    "pp2-zb-recompute": (2, "pp=2,schedule=zero-bubble,recompute=full"),
    # selective recomputation under a split backward: the cache serves both recomputations
    "pp2-zb-selective": (2, "pp=2,schedule=zero-bubble,recompute=activation"),
    # ... and sequence parallelism under it: the input pass does not gather again what only the
    # weight pass reads (the column products' inputs)
    "tp2-pp2-sp-zb-selective": (4, "tp=2,pp=2,sp=on,schedule=zero-bubble,recompute=norm_output"),
    "cp2-ring": (2, "cp=2,attention=ring"),
    # ring attention as one piece under selective recomputation: kept (its output reused) or not
    "cp2-ring-keep": (2, "cp=2,attention=ring,recompute=activation"),
    "cp2-ring-recompute": (2, "cp=2,attention=ring,recompute=attention+activation"),
    "cp2-tp2-ring": (4, "cp=2,tp=2,attention=ring"),
    "cp2-tp2-allgather": (4, "cp=2,tp=2,attention=allgather-kv"),
    "cp2-dp2-zero3": (4, "cp=2,dp=2,zero=3"),  # ZeRO over dp x cp
}
MODELS = {
    "gpt": ("examples/gpt.py", "tiny"),
    "llama3": ("examples/llama3.py", "tiny"),
    # HuggingFace Llama builds an explicit (batch, 1, s, s) causal mask for attention; capture reads
    # it as causal attention (passes/canonicalize.py), so its CP plans run as the examples' do
    "hf_llama": ("tests/models/hf_llama.py", "tiny"),
}
SEQ = {"gpt": 32, "llama3": 64, "hf_llama": 32}
STEPS = 3

# runtime features whose rewrite reads nothing of the model's code beyond its parameters and its
# stage split (data-parallel ZeRO stages, the pipeline schedule once the split is made): the
# matrix runs them on the LLaMA example only
MODEL_AGNOSTIC = (
    "dp2-zero0",
    "dp2-zero1",
    "dp2-zero2",
    "pp2-1f1b",
    "pp2-zero-bubble",
    "pp2-dp2-zero2-zb",
    "pp2-zb-recompute",
    "pp2-zb-selective",
    "cp2-ring-keep",
    "cp2-ring-recompute",
)
PAIRS = [(m, c) for m in MODELS for c in LAYOUTS if m == "llama3" or c not in MODEL_AGNOSTIC]

# CI: every layout's rule once, on the model where it is most at risk, and each model's own graph
# through TP with SP, CP and the pipeline split. ZeRO-1 without a pipeline, 1F1B, interleaved and
# TP without SP run in tests/test_tied.py (a tied model) and tests/runtime/test_resume.py; ZeRO-0
# and ZeRO-2 without a pipeline, and the model-agnostic layouts on the other models, only in the
# matrix.
CI_SUBSET = [
    ("llama3", "tp2-sp-selective"),
    ("llama3", "pp2-zero-bubble"),
    ("llama3", "pp2-zb-recompute"),
    ("llama3", "pp2-zb-selective"),
    ("llama3", "tp2-pp2-sp-zb-selective"),
    ("llama3", "pp2-dp2-zero2-zb"),
    ("llama3", "dp2-zero3"),
    ("llama3", "tp2-pp2-dp2"),
    ("llama3", "cp2-ring-keep"),
    ("llama3", "cp2-ring-recompute"),
    ("llama3", "cp2-tp2-allgather"),
    ("gpt", "tp2-sp"),
    ("gpt", "cp2-tp2-ring"),
    ("gpt", "pp2-dp2-zero3"),
    ("hf_llama", "tp2-sp"),
    ("hf_llama", "cp2-ring"),
    ("hf_llama", "cp2-dp2-zero3"),
]

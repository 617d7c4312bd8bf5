"""Capture: every example and HuggingFace Llama/Mixtral trace, with the documented meta keys."""

import sys

import pytest
import sympy
import torch

from autoshard.capture import capture, capture_file
from autoshard.errors import AutoshardError
from autoshard.ir import OP_CLASSES, B, S

from conftest import EXAMPLES, captured
from graphs import TINY_DECODER

META_KEYS = ("shape", "dtype", "module_path", "module_type", "layer", "region", "op", "op_class")


@pytest.mark.parametrize(
    "name,config,layers,kinds",
    [("gpt", "tiny", 2, [2]), ("llama3", "tiny", 2, [2]), ("deepseek_v3", "tiny", 3, [1, 2])],
)
def test_examples_capture_with_repeated_layers(name, config, layers, kinds):
    cap, _ = captured(name, config, 64)
    assert cap.tracer == "symbolic_trace"
    assert cap.num_layers == layers
    assert [k.count for k in cap.kinds] == kinds
    for n in cap.graph_module.graph.nodes:
        for key in META_KEYS:
            assert key in n.meta, (n.name, key)
        assert n.meta["op_class"] in OP_CLASSES


def test_shapes_are_symbolic_in_batch_and_sequence():
    cap, _ = captured("llama3", "tiny", 64)
    embed = next(n for n in cap.graph_module.graph.nodes if n.meta["op_class"] == "embedding")
    assert embed.meta["shape"] == (B, S, 64)
    sdpa = next(n for n in cap.graph_module.graph.nodes if n.meta["op"] == "scaled_dot_product_attention")
    assert sdpa.meta["shape"] == (B, 4, S, 16)
    assert sdpa.meta["op_class"] == "attention"


def test_op_classes_found_by_graph_pattern():
    cap, _ = captured("deepseek_v3", "tiny", 64)
    classes = {}
    for n in cap.graph_module.graph.nodes:
        classes.setdefault(n.meta["op_class"], set()).add(n.meta["op"])
    assert "bmm" in classes["experts"]  # matmul by a stacked (experts, in, out) weight
    assert "linear" in classes["router"]  # its output reaches topk
    assert "rms_norm" in classes["norm"]
    assert "cross_entropy" in classes["loss"]
    gpt, _ = captured("gpt", "tiny", 64)
    attention_ops = {n.meta["op"] for n in gpt.graph_module.graph.nodes if n.meta["op_class"] == "attention"}
    assert {"matmul", "softmax", "masked_fill"} <= attention_ops


def test_layer_index_and_regions():
    cap, _ = captured("gpt", "tiny", 64)
    by_path = {n.meta["module_path"]: n for n in cap.graph_module.graph.nodes if n.op == "call_module"}
    assert by_path["layers.1.mlp.fc1"].meta["layer"] == 1
    assert by_path["embed"].meta["region"] == "pre"
    assert by_path["head"].meta["region"] == "post"
    assert by_path["layers.0.attn.qkv"].meta["source"].startswith("gpt.py:")


def test_big_configs_capture_on_meta_without_memory():
    cap, cost = captured("llama3", "405b", 8192)
    assert cap.num_layers == 126 and len(cap.kinds) == 1
    assert all(p.device.type == "meta" for p in cap.model.parameters())
    assert cost.params == 405_853_388_800


def _tiny_hf(kind):
    transformers = pytest.importorskip("transformers")
    common = dict(TINY_DECODER)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_huggingface_models_capture_through_export(kind):
    with torch.device("meta"):
        model = _tiny_hf(kind)
    cap = capture(model, seq=32)
    assert cap.tracer == "export"
    assert cap.stack_path == "model.layers" and cap.num_layers == 2
    assert [k.count for k in cap.kinds] == [2]
    classes = {n.meta["op_class"] for n in cap.graph_module.graph.nodes}
    assert {"matmul", "attention", "norm", "embedding", "loss"} <= classes
    if kind == "mixtral":
        assert {"router", "experts"} <= classes
    shapes = [n.meta["shape"] for n in cap.graph_module.graph.nodes if n.meta["op"] == "embedding"]
    assert shapes == [(B, S, 64)]


def test_untraceable_model_names_the_line(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(10, 4)\n"
        "    def forward(self, tokens):\n"
        "        if tokens.sum() > 3:\n"
        "            return self.emb(tokens)\n"
        "        return self.emb(tokens) * 2\n"
        "def build(config=None):\n"
        "    return M()\n"
        "def sample_inputs(config, batch, seq):\n"
        "    return (torch.zeros(batch, seq, dtype=torch.long),)\n"
    )
    with pytest.raises(AutoshardError, match=r"bad\.py:7") as e:
        capture_file(str(f), None, 16)
    assert "\n" not in str(e.value)


def test_model_that_fixes_the_sequence_length_is_reported(tmp_path):
    f = tmp_path / "fixed.py"
    f.write_text(
        "import torch, torch.nn.functional as F\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(10, 4)\n"
        "    def forward(self, tokens):\n"
        "        return F.pad(self.emb(tokens), (0, 0, 0, 1))[:, :-1]\n"
        "def build(config=None):\n"
        "    return M()\n"
        "def sample_inputs(config, batch, seq):\n"
        "    return (torch.zeros(batch, seq, dtype=torch.long),)\n"
    )
    with pytest.raises(AutoshardError, match="fixes the (batch|sequence) size at fixed.py:7"):
        capture_file(str(f), None, 16)


def test_costs_scale_with_batch_and_sequence():
    _, cost = captured("llama3", "tiny", 64)
    blk = cost.blocks[0]
    assert blk.flops.free_symbols == {B, S}
    assert sympy.degree(blk.flops, S) == 2  # attention is quadratic in s
    one, two, three = (blk.eval("flops", b, 64) for b in (1, 2, 3))
    assert three - two == pytest.approx(two - one)  # affine in b (rotary tables depend on s only)
    assert two > 1.9 * one


def test_capture_file_uses_model_file_convention():
    cap = capture_file(str(EXAMPLES / "gpt.py:build"), "tiny", 32)
    assert cap.input_names == ["tokens"]


def test_capture_file_records_the_initialisation_when_first_read(monkeypatch):
    """Planning never reads the initialisation, so capture does not record it; the first read
    records it once, the same table the recorder gives the model built under it."""
    from autoshard.capture import init as init_module
    from autoshard.modelfile import load

    calls = []
    record = init_module.record_build

    def counted(fn, *args, **kwargs):
        calls.append(args)
        return record(fn, *args, **kwargs)

    monkeypatch.setattr(sys.modules["autoshard.capture"], "record_build", counted)
    cap = capture_file(str(EXAMPLES / "llama3.py"), "tiny", 32)
    assert calls == [] and not cap.inits.recorded
    name = "model.layers.0.attn.wq.weight"
    steps = cap.inits[name].steps
    assert calls == [("tiny",)] and cap.inits.recorded
    _, eager = record(load(str(EXAMPLES / "llama3.py")).build, "tiny")
    assert steps == eager[name.removeprefix("model.")].steps
    assert len(cap.inits) == len(eager) and calls == [("tiny",)]


def test_model_file_loss_replaces_the_default(tmp_path):
    f = tmp_path / "withloss.py"
    f.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(10, 4)\n"
        "    def forward(self, tokens):\n"
        "        return self.emb(tokens)\n"
        "def build(config=None):\n"
        "    return M()\n"
        "def sample_inputs(config, batch, seq):\n"
        "    return (torch.zeros(batch, seq, dtype=torch.long),)\n"
        "def loss(output, tokens):\n"
        "    return output.pow(2).mean()\n"
    )
    cap = capture_file(str(f), None, 16)
    ops = [n.meta["op"] for n in cap.graph_module.graph.nodes]
    assert "pow" in ops and "cross_entropy" not in ops


def test_the_public_capture_function_survives_importing_the_capture_package():
    import autoshard
    import autoshard.capture  # rebinds the attribute autoshard.capture to the package

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    first = autoshard.capture(model, seq=16)
    again = autoshard.capture(model, seq=16)
    assert first.tracer == again.tracer == "symbolic_trace"


# ---------------------------------------------------------------------------------------------
# The export path traces one layer per kind and copies the rest (autoshard.capture.repeat)


def _tiny_deep_hf(kind, layers):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        if kind == "llama":
            return transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": layers})
            )
        cfg = transformers.DeepseekV3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=layers,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
        return transformers.DeepseekV3ForCausalLM(cfg)


def _graph_text(cap):
    """Every node's op, target, arguments (by position), layer, module path and shape."""
    index = {n: i for i, n in enumerate(cap.graph_module.graph.nodes)}

    def arg(x):
        if isinstance(x, torch.fx.Node):
            return ("node", index[x])
        if isinstance(x, (list, tuple)):
            return tuple(arg(y) for y in x)
        if isinstance(x, dict):
            return tuple((k, arg(v)) for k, v in x.items())
        return str(x)

    return [
        (n.op, str(n.target), arg(n.args), arg(n.kwargs), n.meta["layer"], n.meta["module_path"], str(n.meta["shape"]))
        for n in cap.graph_module.graph.nodes
    ]


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_cut_export_gives_the_graph_and_costs_of_a_full_export(kind, monkeypatch):
    from collections import Counter

    from autoshard.capture import repeat
    from autoshard.cost_models.analyze import analyze

    model = _tiny_deep_hf(kind, 3)
    expanded = []
    expand = repeat.Cut.expand
    monkeypatch.setattr(repeat.Cut, "expand", lambda self, *a: expanded.append(self.traced) or expand(self, *a))
    cut = capture(model, seq=32)
    # layer 2 was copied, not traced; the bf16 trace's dtype flow is followed on the cut graph,
    # before the copies, which carry it (the full capture below follows the whole graph)
    assert expanded == [[0, 1]]
    monkeypatch.setattr(repeat, "plan", lambda model: None)
    full = capture(model, seq=32)
    assert cut.tracer == full.tracer == "export"
    assert _graph_text(cut) == _graph_text(full)
    per_layer = [Counter(n.meta["layer"] for n in c.graph_module.graph.nodes) for c in (cut, full)]
    assert per_layer[0] == per_layer[1]
    kinds = [[(k.layers, len(c.layer_nodes[k.template])) for k in c.kinds] for c in (cut, full)]
    assert kinds[0] == kinds[1] and len(kinds[0]) == (1 if kind == "llama" else 2)
    a, b = analyze(cut), analyze(full)
    assert a.params == b.params and a.flops_forward(2, 32) == b.flops_forward(2, 32)
    for x, y in zip(a.all_blocks(), b.all_blocks()):
        assert (x.count, x.params, sympy.expand(x.flops - y.flops)) == (y.count, y.params, 0)
        assert x.saved_bytes(2, 32) == y.saved_bytes(2, 32)
    assert {n.target for n in cut.graph_module.graph.nodes if n.op == "get_attr"} == {
        n.target for n in full.graph_module.graph.nodes if n.op == "get_attr"
    }
    assert all(cut.graph_module.get_parameter(n) is p for n, p in full.graph_module.named_parameters())


def test_layer_kinds_are_read_from_the_modules():
    from autoshard.capture.structure import module_kinds

    class Layer(torch.nn.Module):
        def __init__(self, index, window, width=8):
            super().__init__()
            self.layer_idx = index  # an index: differs in every layer, not compared
            self.groups = 2  # equal to one layer's index only: compared
            self.window = window
            self.proj = torch.nn.Linear(width, width)

    layers = [Layer(0, None), Layer(1, 4), Layer(2, None), Layer(3, 4), Layer(4, None, width=16)]
    assert module_kinds(layers) == [0, 1, 0, 1, 2]
    assert module_kinds([layers[0], layers[0]]) is None  # one layer used twice is not a copy


def test_a_layer_that_returns_more_than_its_input_is_exported_whole(monkeypatch):
    """A cut capture cannot stand for layers handing two tensors on: export every layer."""
    import sys

    from autoshard.capture import repeat

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, carry):
            return self.proj(x) + carry, carry * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(4))
            self.head = torch.nn.Linear(8, 16)

        def forward(self, tokens):
            x = self.embed(tokens)
            carry = x
            for layer in self.layers:
                x, carry = layer(x, carry)
            return self.head(x)

    trace_module = sys.modules["autoshard.capture.trace"]
    monkeypatch.setattr(trace_module, "_symbolic_trace", lambda wrapper: (_ for _ in ()).throw(TypeError("no fx")))
    expanded = []
    monkeypatch.setattr(repeat.Cut, "expand", lambda self, *a: expanded.append(1))
    with torch.device("meta"):
        model = Model()
    cap = capture(model, seq=16)
    assert cap.tracer == "export" and not expanded
    assert sorted({n.meta["layer"] for n in cap.graph_module.graph.nodes if n.meta["op"] == "linear"} - {None}) == [
        0,
        1,
        2,
        3,
    ]


# ---------------------------------------------------------------------------------------------
# Data-dependent sizes: estimated under a stated assumption, or one line naming the op

MODELS = EXAMPLES.parent / "tests" / "models"


def test_naive_moe_is_captured_grouped_with_balanced_routing_flops(capsys):
    from autoshard.cli import main
    from autoshard.cost_models.analyze import analyze

    assert main(["inspect", str(MODELS / "naive_moe.py"), "--config", "tiny", "--seq-len", "32"]) == 0
    # canonicalisation turns the loop over experts into grouped GEMMs (passes.moe_forms): no
    # expert's row count depends on the data any more, so nothing is assumed about the routing
    assert "Assumed:" not in capsys.readouterr().out
    moe = capture_file(str(MODELS / "naive_moe.py"), "tiny", 32)
    dense = capture_file(str(MODELS / "naive_moe.py"), "tiny_dense", 32)
    assert moe.notes == []
    moe_cost = analyze(moe)
    a, b = moe_cost.blocks[0], analyze(dense).blocks[0]
    # top-2 of 4 experts: each token through two expert MLPs, as the dense model's two MLP slots;
    # the MoE adds its router. The ModuleList's MLPs are found as experts from the routing (each
    # reads the tokens where(choices == i) selects), not from their names
    mlp_slots = 2 * (2 * 64 * 96 * 2) * B * S  # two slots of up and down
    assert sympy.expand(b.flops_by_class["matmul"] - a.flops_by_class["matmul"] - mlp_slots) == 0
    assert sympy.expand(a.flops_experts - mlp_slots) == 0 and a.flops_by_class["experts"] == a.flops_experts
    assert a.flops_by_class["router"] == 2 * 64 * 4 * B * S
    assert moe_cost.facts["experts"] == 4 and a.params_experts == 4 * 2 * 64 * 96
    # one grouped GEMM per projection, in the MoE module, nothing past the combine
    experts = [n for n in moe.graph_module.graph.nodes if n.meta["op_class"] == "experts"]
    assert len(experts) == 4 and {n.meta["module_path"] for n in experts} == {"layers.0.ffn", "layers.1.ffn"}
    assert sorted((g.batch, g.n, g.k) for g in a.gemms if g.experts) == [(4, 64, 96), (4, 96, 64)]
    # each expert's tokens dispatched: 2 slots of 64; and the stacks of the experts' own parameters
    # exchanged into whole experts (their rows held 1/ep per rank)
    tokens = [c for c in a.collectives if c.axis == "ep" and c.kind == "all_to_all"]
    assert sympy.expand(sum(c.elems for c in tokens) - 2 * 64 * B * S) == 0
    assert sorted(c.elems for c in a.collectives if c.kind == "weights") == [4 * 64 * 96, 4 * 96 * 64]
    assert all(
        d.free_symbols <= {B, S}
        for n in moe.graph_module.graph.nodes
        for d in (n.meta["shape"] or ())
        if hasattr(d, "free_symbols")
    )


def test_data_dependent_size_on_the_fx_path_is_estimated(tmp_path):
    f = tmp_path / "fx_moe.py"
    f.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(MODELS)!r})\n"
        "import naive_moe\n"
        "class FxMoE(naive_moe.MoE):\n"
        "    def forward(self, x):\n"
        "        shape = x.shape\n"
        "        x = x.reshape(-1, shape[-1])\n"
        "        w, topi = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)\n"
        "        out = torch.zeros_like(x)\n"
        "        for i, expert in enumerate(self.experts):\n"
        "            idx, slot = torch.where(topi == i)\n"
        "            out = out.index_add(0, idx, w[idx, slot, None] * expert(x[idx]))\n"
        "        return out.reshape(shape)\n"
        "naive_moe.MoE = FxMoE\n"
        "CONFIGS, build, sample_inputs = naive_moe.CONFIGS, naive_moe.build, naive_moe.sample_inputs\n"
    )
    from autoshard.cost_models.analyze import analyze

    cap = capture_file(str(f), "tiny", 32)
    assert cap.tracer == "symbolic_trace"
    assert len(cap.notes) == 1 and cap.notes[0].startswith("fx_moe.py:11 (where)")
    dense = analyze(capture_file(str(MODELS / "naive_moe.py"), "tiny_dense", 32)).blocks[0]
    moe = analyze(cap).blocks[0]
    assert moe.params_experts == 4 * 2 * 64 * 96  # nn.Linear modules (call_module) found as experts too
    assert sympy.expand(moe.flops_by_class["matmul"] + moe.flops_experts - dense.flops_by_class["matmul"]) == 0


def test_a_size_that_cannot_be_estimated_names_the_op_and_line(tmp_path):
    f = tmp_path / "masked.py"
    f.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(10, 4)\n"
        "        self.head = torch.nn.Linear(4, 10)\n"
        "    def forward(self, tokens):\n"
        "        x = self.emb(tokens)\n"
        "        kept = x[x.sum(-1) > 0]\n"
        "        return self.head(x) + self.head(kept).sum()\n"
        "def build(config=None):\n"
        "    return M()\n"
        "def sample_inputs(config, batch, seq):\n"
        "    return (torch.zeros(batch, seq, dtype=torch.long),)\n"
    )
    with pytest.raises(AutoshardError, match=r"masked\.py:9 \(\w+\) has a data-dependent size") as e:
        capture_file(str(f), None, 16)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_transformers_moe_models_inspect_cleanly(kind):
    transformers = pytest.importorskip("transformers")
    from autoshard.cost_models.analyze import analyze
    from autoshard.summary import format_inspection, inspect_model

    common = dict(TINY_DECODER)
    with torch.device("meta"):
        if kind == "mixtral":
            model = transformers.MixtralForCausalLM(
                transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
            )
        else:
            cfg = transformers.Qwen3MoeConfig(
                **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
            )
            model = transformers.Qwen3MoeForCausalLM(cfg)
    cost = analyze(capture(model, seq=32))
    text = format_inspection(inspect_model(cost, 32), kind)
    assert "FLOPs per token" in text
    assert cost.flops_forward(1, 32) > 0 and cost.blocks[0].flops_by_class.get("experts", 0) != 0


# ---------------------------------------------------------------------------------------------
# Experts found from the routing whatever form they take (tests/models/hf_moe.py)


def _hf_moe(config: str):
    pytest.importorskip("transformers")
    from autoshard.cost_models.analyze import analyze

    return analyze(capture_file(str(MODELS / "hf_moe.py"), config, 32))


@pytest.mark.parametrize("arch,experts", [("mixtral", 4), ("deepseek_v3", 8)])
def test_batched_experts_cost_as_the_grouped_form(arch, experts):
    """transformers' ``batched_mm`` gathers each token's expert weights (``W[choices]``, then
    bmm): the same experts as its grouped GEMMs, at the same FLOPs, parameters and dispatch."""
    grouped, batched = _hf_moe(arch), _hf_moe(f"{arch}-batched")
    g, b = grouped.blocks[-1], batched.blocks[-1]
    assert batched.facts["experts"] == grouped.facts["experts"] == experts
    assert b.params_experts == g.params_experts > 0
    assert sympy.expand(b.flops_experts - g.flops_experts) == 0 and b.flops_experts != 0  # exact
    assert sympy.expand(b.flops_by_class["router"] - g.flops_by_class["router"]) == 0
    shapes = [sorted((str(x.m), x.n, x.k, x.batch, x.count) for x in c.gemms if x.experts) for c in (b, g)]
    assert shapes[0] == shapes[1]
    assert [str(c.elems) for c in b.collectives if c.axis == "ep"] == [
        str(c.elems) for c in g.collectives if c.axis == "ep"
    ]
    # the gathered weights are not priced as a copy per routed token (which would be b*s*8192 B
    # and more): no more pointwise traffic than the grouped form's sort and gathers of tokens
    at = {B: 1, S: 4096}
    assert b.bytes_pointwise.subs(at) <= g.bytes_pointwise.subs(at)
    # the rest (norms, attention, casts) within 2% of the whole forward
    assert abs(b.flops.subs(at) - g.flops.subs(at)) <= 0.02 * g.flops.subs(at)


def test_a_loop_over_data_dependent_expert_ids_names_the_module_and_the_fix():
    """transformers' eager experts loop over ``nonzero`` of the experts hit: no tracer unrolls
    that; the error names the module and line, and the implementation that captures."""
    pytest.importorskip("transformers")
    with pytest.raises(AutoshardError) as e:
        capture_file(str(MODELS / "hf_moe.py"), "mixtral-eager", 32)
    message = str(e.value)
    assert message.startswith("cannot trace model.layers.0.mlp.experts (MixtralExperts, modeling_mixtral.py:")
    assert "`for expert_idx in expert_hit:` is a Python loop over data-dependent ids" in message
    assert 'config._experts_implementation = "grouped_mm"' in message and "\n" not in message


def test_a_loop_over_data_dependent_ids_in_any_model_names_its_module(tmp_path):
    f = tmp_path / "hit.py"
    f.write_text(
        "import torch\n"
        "class Hits(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        out = torch.zeros_like(x)\n"
        "        for i in (x.sum(-1) > 0).flatten().nonzero():\n"
        "            out = out + self.proj(x) * i\n"
        "        return out\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(10, 4)\n"
        "        self.hits = Hits()\n"
        "        self.head = torch.nn.Linear(4, 10)\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.hits(self.emb(tokens)))\n"
        "def build(config=None):\n"
        "    return M()\n"
        "def sample_inputs(config, batch, seq):\n"
        "    return (torch.zeros(batch, seq, dtype=torch.long),)\n"
    )
    with pytest.raises(AutoshardError, match=r"^cannot trace hits \(Hits, hit\.py:8\): `for i in") as e:
        capture_file(str(f), None, 16)
    assert "transformers" not in str(e.value) and "\n" not in str(e.value)


def _dtypes_of_adds(gm, params_dtype, autocast: bool) -> dict[str, torch.dtype]:
    """The dtype of every add's result, running ``gm`` on real tensors with its parameters in
    ``params_dtype`` (under bf16 autocast where asked)."""
    import copy

    from torch import fx

    gm = copy.deepcopy(gm).to_empty(device="cpu")
    for p in gm.parameters():
        p.data = torch.randn(p.shape).to(params_dtype)
    for name, b in gm.named_buffers():
        if name.endswith("inv_freq"):
            b.copy_(1.0 / (10000 ** (torch.arange(0, b.numel() * 2, 2).float() / (b.numel() * 2))))
    seen = {}

    class Watch(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and n.meta.get("op") == "add" and isinstance(out, torch.Tensor):
                seen[n.name] = out.dtype
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        Watch(gm).run(torch.randint(0, 128, (2, 16)))
    return seen


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_an_exported_model_keeps_the_dtypes_it_has_with_bf16_parameters(kind):
    """torch.export records a cast that changes nothing as its input, so an fp32 trace of
    transformers' RMSNorm (``x.to(torch.float32)`` first) has every residual add read an fp32
    copy, and casts to the parameters' dtype as casts to fp32: a bf16 program would carry an fp32
    residual stream. Captured, the graph follows a bf16 trace: the residual stream and the
    norms' outputs are bf16 in a bf16 program, fp32 in an fp32 one."""
    cap = capture(_tiny_deep_hf(kind, 2), seq=16)
    graph = cap.graph_module.graph
    casts = [n for n in graph.nodes if n.meta.get("op") in ("to", "_to_copy")]
    reads_cast = [n.name for n in graph.nodes if n.meta.get("op") == "add" and any(a in casts for a in n.args)]
    assert not reads_cast, reads_cast
    assert any(n.meta.get("op") == "to_compute" for n in graph.nodes)  # rotary tables, norms' outputs
    norms = [n for n in graph.nodes if n.meta.get("op") == "rms_norm"]
    assert norms and not any(n.args[0] in casts for n in norms)
    import re

    layer_of = {n.name: n.meta.get("module_path", "") for n in graph.nodes}
    low = _dtypes_of_adds(cap.graph_module, torch.bfloat16, autocast=True)
    residual = {name: d for name, d in low.items() if re.fullmatch(r"model\.layers\.\d+", layer_of[name])}
    assert len(residual) == 4 and set(residual.values()) == {torch.bfloat16}, residual  # two a layer
    # fp32 stays where the model asks for it: a norm's statistics written out (DeepSeek's q/kv norms
    # over a projection's features), the router's scores
    full = _dtypes_of_adds(cap.graph_module, torch.float32, autocast=False)
    assert {d for d in full.values() if d.is_floating_point} == {torch.float32}


def test_the_bf16_trace_lowers_a_model_in_place_and_puts_it_back():
    from autoshard.capture import dtypes

    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_DECODER, "tie_word_embeddings": True}))
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with dtypes.lowered(model):
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert {b.dtype for b in model.buffers()} == {torch.float32}  # rotary tables keep theirs
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still one parameter
    assert all(model.get_parameter(name) is p for name, p in params.items())  # the same objects back
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


# ---------------------------------------------------------------------------------------------
# Constants lifted from the forward


def test_a_constant_of_the_forward_becomes_a_buffer_holding_its_value(monkeypatch):
    """torch.export lifts a list index (Falcon's ``fused_qkv[..., [-2], :]``) and ``new_tensor``
    data into constants, which on the meta device hold no values: capture makes each a
    non-persistent buffer holding its value, which every rank takes, whatever else initialises
    the model (which holds no such tensor)."""
    import sys
    import types

    from autoshard.capture import record_build
    from autoshard.runtime.stages import materialise, put_buffer

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 16)

        def forward(self, x):
            picked = self.proj(x).view(x.size(0), x.size(1), 4, 4)[..., [-2], :].flatten(-2)
            return x + picked.repeat(1, 1, 2) * x.new_tensor([0.5])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(3))
            self.head = torch.nn.Linear(8, 16)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    trace_module = sys.modules["autoshard.capture.trace"]
    monkeypatch.setattr(trace_module, "_symbolic_trace", lambda wrapper: (_ for _ in ()).throw(TypeError("no fx")))
    model, inits = record_build(Model)
    cap = capture(model, seq=16, inits=inits)
    assert cap.tracer == "export"
    gm = cap.graph_module
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    held = {f"model.{k}" for k, _ in [*model.named_parameters(), *model.named_buffers()]}
    lifted = {k: v for k, v in gm.named_buffers() if k in read - held}
    assert sorted(v.tolist() for v in lifted.values()) == [[-2]] * 3 + [[0.5]] * 3
    assert not set(lifted) & set(gm.state_dict())  # non-persistent: no checkpoint holds them
    for name, value in lifted.items():  # the program's initialisation, where the model has none
        stage = torch.nn.Module()
        put_buffer(stage, name, torch.empty(value.shape, dtype=value.dtype, device="meta"))
        tables = {"SHARDS": {}, "ORIGIN": {}, "INIT": {name: cap.inits[name].steps}, "__file__": "stage0.py"}
        materialise(stage, types.SimpleNamespace(**tables), torch.device("cpu"), 0, 1, full_state={})
        assert torch.equal(stage.get_buffer(name), value)

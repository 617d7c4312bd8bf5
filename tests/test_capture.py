"""Capture: every example and HuggingFace Llama/Mixtral trace, with the documented meta keys."""

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

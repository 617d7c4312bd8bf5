"""Tensor-parallel pass: the rewritten graph has the collectives and local shapes it should
(Before/Expected), and two gloo processes running it reproduce the single-device loss and
gradients."""

import sys

import pytest
import torch

from autoshard import runtime
from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.errors import AutoshardError
from autoshard.passes.tensor_parallel import ParamShard, load_local, slice_parameter, tensor_parallel

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _sharded(name: str, tp: int, seq: int = 16):
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    cap = capture(model, (torch.zeros(2, seq, dtype=torch.long),))
    analyze(cap)
    return model, tensor_parallel(cap.graph_module, tp)


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_llama_tp2_graph_has_megatron_collectives_and_local_shapes():
    _, sg = _sharded("llama3", 2)
    gm = sg.gm
    # Before: 2 layers x (attention + MLP) regions, a vocabulary-parallel head and embedding
    # Expected: one f per region input (q/k/v share theirs), one g per row matmul
    assert len(_calls(gm, runtime.copy_to_tp)) == 2 * 2 + 1
    assert len(_calls(gm, runtime.reduce_from_tp)) == 2 * 2
    assert len(_calls(gm, runtime.vocab_parallel_embedding)) == 1
    assert len(_calls(gm, runtime.vocab_parallel_cross_entropy)) == 1
    shapes = {k: tuple(v.shape) for k, v in gm.named_parameters()}
    assert shapes["model.layers.0.attn.wq.weight"] == (32, 64)  # 4 heads -> 2
    assert shapes["model.layers.0.attn.wk.weight"] == (16, 64)  # 2 KV heads -> 1 (GQA)
    assert shapes["model.layers.0.attn.wo.weight"] == (64, 32)
    assert shapes["model.layers.0.ffn.w1.weight"] == (80, 64)
    assert shapes["model.layers.0.ffn.w2.weight"] == (64, 80)
    assert shapes["model.embed.weight"] == (128, 64)
    assert shapes["model.output.weight"] == (128, 64)
    assert shapes["model.layers.0.attn_norm.weight"] == (64,)  # norms stay whole
    views = {n.name: n.args[1:] for n in gm.graph.nodes if n.op == "call_method" and n.target in ("view", "reshape")}
    assert views["view"][2:] == (2, 16) and views["view_1"][2:] == (1, 16)  # heads constants rewritten
    assert views["reshape"][2:] == (32,)
    assert "column-parallel, out_features 64 -> 32" in sg.notes["model_layers_0_attn_wq"]


def test_gpt_fused_qkv_is_split_by_heads_not_by_q_k_v():
    _, sg = _sharded("gpt", 2)
    spec = sg.shards["model.layers.0.attn.qkv.weight"]
    assert spec == ParamShard(0, (3, 4, 16), 1)  # (q|k|v, heads, head_dim): split the heads
    full = torch.arange(192.0).unsqueeze(1)
    rows = slice_parameter(full, spec, 1, 2).squeeze(1)
    # rank 1 holds heads 2-3 of q, of k and of v
    expected = torch.cat([torch.arange(32.0, 64.0), torch.arange(96.0, 128.0), torch.arange(160.0, 192.0)])
    assert torch.equal(rows, expected)
    bias = [n for n in sg.gm.graph.nodes if n.op == "get_attr" and n.target.endswith("proj_bias")]
    assert bias and all(n.users and next(iter(n.users)).args[0].target is runtime.reduce_from_tp for n in bias)


def test_indivisible_split_is_a_clear_error():
    with pytest.raises(AutoshardError, match="do not divide by tp=3"):
        _sharded("llama3", 3)


def _tp_worker(rank, world, name):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    model, sg = _sharded(name, world)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    reference = causal_lm_loss(model(tokens), tokens)
    reference.backward()
    full = {f"model.{k}": v for k, v in model.state_dict().items()}
    grads = {f"model.{k}": p.grad for k, p in model.named_parameters()}
    load_local(sg, full, rank)
    loss = sg.gm(tokens)
    loss.backward()
    worst = 0.0
    for local_name, p in sg.gm.named_parameters():
        source = sg.origin.get(local_name, local_name)
        g = grads[source]
        spec = sg.shards.get(source)
        g = slice_parameter(g, spec, rank, world) if spec else g
        worst = max(worst, (p.grad - g).abs().max().item() / (g.abs().max().item() + 1e-12))
    runtime.set_groups(tp=None)
    return abs(loss.item() - reference.item()) / abs(reference.item()), worst


@pytest.mark.parametrize("name", ["llama3", "gpt"])
def test_tp2_on_two_processes_matches_single_device(name):
    from distributed import run

    for loss_err, grad_err in run(_tp_worker, 2, name, timeout=120):
        assert loss_err < 1e-5
        assert grad_err < 1e-5

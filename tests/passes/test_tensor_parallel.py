"""Tensor-parallel pass: the rewritten graph has the collectives and local shapes it should
(Before/Expected), and two gloo processes running it reproduce the single-device loss and
gradients."""

import sys

import pytest
import torch

from autoshard import runtime
from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.ir import B, S, ops
from autoshard.passes.contract import Refusal, RewriteContext, decisions
from autoshard.passes.tensor_parallel import ParamShard, load_local, slice_parameter, tensor_parallel

from conftest import EXAMPLES
from graphs import notes

sys.path.insert(0, str(EXAMPLES))


def _sharded(name: str, tp: int, seq: int = 16):
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    cap = capture(model, (torch.zeros(2, seq, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(tp=tp)
    return model, tensor_parallel(cap.graph_module, ctx), ctx


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_llama_tp2_graph_has_megatron_collectives_and_local_shapes():
    _, gm, ctx = _sharded("llama3", 2)
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
    assert "column-parallel, out_features 64 -> 32" in notes(gm)["model_layers_0_attn_wq"]


def test_gpt_fused_qkv_is_split_by_heads_not_by_q_k_v():
    _, gm, ctx = _sharded("gpt", 2)
    spec = decisions(gm).shards["model.layers.0.attn.qkv.weight"]
    assert spec == ParamShard(0, (3, 4, 16), 1)  # (q|k|v, heads, head_dim): split the heads
    full = torch.arange(192.0).unsqueeze(1)
    rows = slice_parameter(full, spec, 1, 2).squeeze(1)
    # rank 1 holds heads 2-3 of q, of k and of v
    expected = torch.cat([torch.arange(32.0, 64.0), torch.arange(96.0, 128.0), torch.arange(160.0, 192.0)])
    assert torch.equal(rows, expected)
    bias = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("proj_bias")]
    assert bias and all(n.users and next(iter(n.users)).args[0].target is runtime.reduce_from_tp for n in bias)


def test_indivisible_split_is_a_clear_error():
    with pytest.raises(Refusal, match="do not divide by tp=3") as e:
        _sharded("llama3", 3)
    assert (e.value.axis, e.value.value) == ("tp", 3)
    # the planner leaves out every degree that does not divide that dimension, not only 3
    assert e.value.exclusion()[0] == "divides" and e.value.exclusion()[1] % 3


def _tp_worker(rank, world, name):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    model, gm, ctx = _sharded(name, world)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    reference = causal_lm_loss(model(tokens), tokens)
    reference.backward()
    full = {f"model.{k}": v for k, v in model.state_dict().items()}
    grads = {f"model.{k}": p.grad for k, p in model.named_parameters()}
    load_local(gm, ctx, full, rank)
    loss = gm(tokens)
    loss.backward()
    worst = 0.0
    for local_name, p in gm.named_parameters():
        source = decisions(gm).origin.get(local_name, local_name)
        g = grads[source]
        spec = decisions(gm).shards.get(source)
        g = slice_parameter(g, spec, rank, world) if spec else g
        worst = max(worst, (p.grad - g).abs().max().item() / (g.abs().max().item() + 1e-12))
    runtime.set_groups(tp=None)
    return abs(loss.item() - reference.item()) / abs(reference.item()), worst


@pytest.mark.parametrize("name", ["llama3", "gpt", "deepseek_v3"])
def test_tp2_on_two_processes_matches_single_device(name):
    """deepseek_v3: MLA's split q/k heads, and the shared RoPE key expanded into the split heads
    (its gradient summed over the ranks by the f on its input)."""
    from distributed import run

    for loss_err, grad_err in run(_tp_worker, 2, name, timeout=120):
        assert loss_err < 1e-5
        assert grad_err < 1e-5


# ---------------------------------------------------------------------------------------------
# Before/Expected on small hand-written models


class _FFN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64, bias=False)
        self.fc2 = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 64)
        self.mlp = _FFN()
        self.head = torch.nn.Linear(64, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.mlp(x))


def _rewrite(model, tp=2, seq=8):
    cap = capture(model, (torch.zeros(2, seq, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(tp=tp)
    return tensor_parallel(cap.graph_module, ctx), ctx


def _program(gm, prefix):
    """(op, in, out) of the computing nodes of module ``prefix``, in program order."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module") and n.meta.get("module_path", "").startswith(prefix):
            m = gm.get_submodule(n.target) if n.op == "call_module" else None
            out.append((n.meta["op"], m.in_features, m.out_features) if m is not None else (n.meta["op"],))
    return out


def test_two_linear_mlp_becomes_copy_column_gelu_row_reduce():
    gm, ctx = _rewrite(_MLP())
    assert _program(gm, "mlp") == [
        ("copy_to_tp",),
        ("linear", 64, 32),
        ("gelu",),
        ("linear", 32, 64),
        ("reduce_from_tp",),
    ]
    assert decisions(gm).shards["model.mlp.fc1.weight"] == ParamShard(0, (64,), 0)
    assert decisions(gm).shards["model.mlp.fc2.weight"] == ParamShard(1, (64,), 0)
    inserted = [n for n in gm.graph.nodes if n.target in (runtime.copy_to_tp, runtime.reduce_from_tp)]
    assert all(n.meta["op_class"] == "other" and n.meta["shape"] is not None for n in inserted)


class _Zoo(torch.nn.Module):
    """One TP region per block that passes a head/feature split through an op of every
    transfer rule of the op table (ops.TP_RULES)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.proj = torch.nn.Linear(32, 32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        F = torch.nn.functional
        x = self.embed(tokens)
        b, s = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(x).split(32, dim=-1)  # split: equal parts of the split dimension
        q = F.rms_norm(q.view(b, s, 4, 8), (8,)).transpose(1, 2)  # view, norm (per head), transpose
        k = k.view(b, s, 4, 8)
        k = torch.view_as_real(torch.view_as_complex(k.reshape(b, s, 4, 4, 2))).flatten(3)  # complex
        k = (k - k.mean(-1, keepdim=True)).permute(0, 2, 1, 3)  # reduce (per head), permute
        v = v.reshape(b, s, 4, 8).transpose(1, 2)
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # attention
        scores = torch.matmul(q, k.transpose(-2, -1)) * 0.125  # matmul, pointwise
        written = torch.matmul(F.softmax(scores, dim=-1), v)  # softmax
        out = (fused + written).transpose(1, 2).reshape(b, s, 32)
        x = x + self.proj(out)  # linear (row)
        a, g = self.up(x).chunk(2, dim=-1)  # split (chunk)
        h = (F.silu(g) * a).unsqueeze(2).expand(-1, -1, 2, -1)  # unsqueeze, expand
        h0, h1 = h.unbind(2)  # split (unbind)
        h = torch.stack([h0, h1], dim=2)  # stack
        h = h.select(2, 0) + h.narrow(2, 1, 1).squeeze(2)  # select, slice (narrow), squeeze
        c = torch.cat([h.unsqueeze(2), h.unsqueeze(2)], dim=2)  # cat
        h = c[:, :, 0] + c[..., 1, :]  # getitem
        x = x + self.down(h)
        return self.head(x)  # linear (vocabulary), then loss


def _local_shapes(gm, ctx):
    """Rank 0's shapes of every node, run without a TP group (collectives are identities)."""
    torch.manual_seed(0)
    full = {f"model.{k}": v for k, v in _Zoo().state_dict().items()}
    load_local(gm, ctx, full, 0)
    shapes = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            shapes[n] = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            return value

    Recorder(gm).run(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0)))  # rank 0's rows
    return shapes


@pytest.fixture(scope="module")
def zoo():
    gm, ctx = _rewrite(_Zoo())
    return gm, ctx, _local_shapes(gm, ctx)


def _halved(node, shapes):
    glob = tuple(int(d.subs({B: 2, S: 8})) if hasattr(d, "subs") else d for d in node.meta["shape"])
    return any(g == 2 * loc for g, loc in zip(glob, shapes[node])) and len(glob) == len(shapes[node])


@pytest.mark.parametrize("kind", sorted(ops.TP_RULES))
def test_every_transfer_rule_carries_a_split(zoo, kind):
    """For each kind of TP rule, a node of that kind in the zoo holds a 1/tp slice on rank 0
    (for the row matmul and the loss, which end a region: its split input does)."""
    gm, _, shapes = zoo
    if kind == "loss":  # the rule rewrites it: the vocabulary-parallel cross-entropy reads the split logits
        nodes = [n for n in gm.graph.nodes if n.target is runtime.vocab_parallel_cross_entropy]
    else:
        nodes = [n for n in gm.graph.nodes if ops.rule_of(n) and ops.rule_of(n).tp == kind]
    assert nodes, f"no {kind} node in the rewritten zoo"
    if kind in ("linear", "loss"):  # they end a region: their split input
        checked = [n.all_input_nodes[0] for n in nodes]
    else:  # a split's parts are what its getitems read
        checked = [u for n in nodes for u in (n.users if n.meta.get("shape") is None else [n])]
    assert any(shapes.get(n) and _halved(n, shapes) for n in checked), kind


def test_fused_qkv_split_takes_each_parts_heads(zoo):
    gm, ctx, _ = zoo
    assert decisions(gm).shards["model.qkv.weight"] == ParamShard(0, (3, 32), 1)  # q|k|v, each split in 2
    assert decisions(gm).shards["model.up.weight"] == ParamShard(0, (2, 32), 1)  # chunk(2): a and g each split
    (split,) = [n for n in gm.graph.nodes if n.meta.get("op") == "split"]
    assert split.args[1] == 16  # split(32) of the full features -> split(16) of this rank's


def test_softmax_over_the_split_dimension_is_refused_with_the_line():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.up = torch.nn.Linear(32, 64)
            self.down = torch.nn.Linear(64, 32)

        def forward(self, tokens):
            x = self.embed(tokens)
            return x + self.down(torch.softmax(self.up(x), dim=-1))

    with pytest.raises(Refusal, match=r"softmax over the split dimension; plan with --force tp=1") as e:
        _rewrite(Bad())
    # the model, not the degree, is the obstacle: every degree above 1 is refused in one round
    assert (e.value.axis, e.value.value, e.value.exclusion()) == ("tp", None, "*")
    assert "test_tensor_parallel.py:" in str(e.value)


def _zoo_worker(rank, world):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    torch.manual_seed(0)
    model = _Zoo()
    gm, ctx = _rewrite(_Zoo())
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = causal_lm_loss(model(tokens), tokens)
    reference.backward()
    load_local(gm, ctx, {f"model.{k}": v for k, v in model.state_dict().items()}, rank)
    loss = gm(tokens)
    loss.backward()
    worst = 0.0
    for name, p in gm.named_parameters():
        source = decisions(gm).origin.get(name, name)
        g = dict(model.named_parameters())[source.removeprefix("model.")].grad
        spec = decisions(gm).shards.get(source)
        g = slice_parameter(g, spec, rank, world) if spec else g
        worst = max(worst, (p.grad - g).abs().max().item() / (g.abs().max().item() + 1e-12))
    runtime.set_groups(tp=None)
    return abs(loss.item() - reference.item()) / abs(reference.item()), worst


def test_zoo_tp2_on_two_processes_matches_single_device():
    from distributed import run

    for loss_err, grad_err in run(_zoo_worker, 2, timeout=120):
        assert loss_err < 1e-5
        assert grad_err < 1e-5


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _gpt2_worker(rank, world):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    model = _gpt2()
    cap = capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(tp=world)
    gm = tensor_parallel(cap.graph_module, ctx)
    assert decisions(gm).shards["model.transformer.h.0.attn.c_attn.weight"] == ParamShard(1, (3, 64), 1)  # q|k|v heads
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = causal_lm_loss(model(tokens).logits, tokens)
    reference.backward()
    load_local(gm, ctx, {f"model.{k}": v for k, v in model.state_dict().items()}, rank)
    loss = gm(tokens)
    loss.backward()
    grads = {f"model.{k}": p.grad for k, p in model.named_parameters()}
    worst = 0.0
    for name, p in gm.named_parameters():
        source = decisions(gm).origin.get(name, name)
        spec = decisions(gm).shards.get(source)
        g = slice_parameter(grads[source], spec, rank, world) if spec else grads[source]
        worst = max(worst, (p.grad - g).abs().max().item() / (g.abs().max().item() + 1e-12))
    runtime.set_groups(tp=None)
    return abs(loss.item() - reference.item()) / abs(reference.item()), worst


def test_hf_gpt2_fused_qkv_split_on_two_processes_matches_single_device():
    """transformers' GPT-2: Conv1D (addmm by an (in, out) weight) and the fused-QKV split."""
    from distributed import run

    _gpt2()
    for loss_err, grad_err in run(_gpt2_worker, 2, timeout=240):
        assert loss_err < 1e-5
        assert grad_err < 1e-5


def test_the_pass_keeps_its_contract_and_its_check_sees_a_full_weight():
    from autoshard.passes import PASSES, run_passes
    from autoshard.passes.tensor_parallel import full_weights_left

    cap = capture(_MLP(), (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    untouched = RewriteContext(tp=2)
    assert "keeps the full weight model.mlp.fc1.weight" in full_weights_left(cap.graph_module, untouched)
    ctx = RewriteContext(tp=2)
    gm = run_passes([p for p in PASSES if p.name == "tensor_parallel"], cap.graph_module, ctx)  # checks ensures
    assert full_weights_left(gm, ctx) is None


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention as transformers writes it, and attention inputs left whole


def _hf_mla():
    """transformers' DeepseekV3 with one dense layer: MLA, whose keys are assembled in place
    (``new_empty``, then the per-head part and the rope part shared by all heads copied in)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg)


def test_hf_mla_keys_values_and_queries_carry_the_same_local_heads():
    model = _hf_mla()
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(tp=2)
    gm = tensor_parallel(cap.graph_module, ctx)
    assert not [n for n in gm.graph.nodes if n.meta.get("op") in ("copy_", "new_empty")]  # one cat instead
    # kv_b_proj's rows are (heads, k_nope | v): split by heads, as q_b_proj's (heads, nope | rope)
    assert decisions(gm).shards["model.model.layers.0.self_attn.kv_b_proj.weight"] == ParamShard(0, (4, 32), 0)
    assert decisions(gm).shards["model.model.layers.0.self_attn.q_b_proj.weight"] == ParamShard(0, (4, 24), 0)
    assert "model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight" not in decisions(gm).shards  # low rank: whole
    state = [*model.named_parameters(), *model.named_buffers()]  # the rope's frequencies are not persistent
    load_local(gm, ctx, {f"model.{k}": v.detach() for k, v in state}, 0)
    seen = {}

    class Recorder(torch.fx.Interpreter):  # rank 0, without a TP group: collectives are identities
        def run_node(self, n):
            value = super().run_node(n)
            if ops.rule_of(n) is not None and ops.rule_of(n).tp == "attention":
                seen[n.name] = [tuple(a.shape) for a in self.fetch_args_kwargs_from_env(n)[0][:3]]
            return value

    Recorder(gm).run(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)))  # rank 0's rows
    assert list(seen.values()) == [[(2, 2, 8, 24), (2, 2, 8, 24), (2, 2, 8, 16)]]  # q, k, v: 2 of 4 heads


class _WholeKeys(torch.nn.Module):
    """Keys from a projection normalised over all its features (the analysis leaves it whole),
    queries and values split by heads."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        F = torch.nn.functional
        x = self.embed(tokens)
        b, s = tokens.size(0), tokens.size(1)
        q, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.v))
        k = F.rms_norm(self.k(x), (32,)).view(b, s, 4, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 32)
        return self.head(x + self.o(out))


def test_attention_whose_keys_stay_whole_is_refused_by_name():
    with pytest.raises(Refusal, match=r"its key transpose_2 keeps all 4 heads, another input is split") as e:
        _rewrite(_WholeKeys())
    assert (e.value.axis, e.value.exclusion()) == ("tp", "*")  # whatever the degree


# ---------------------------------------------------------------------------------------------
# Complex-number rotary embeddings (Llama 4, DeepSeek-V2)


class _ComplexRope(torch.nn.Module):
    """Queries and keys rotated as Llama 4 and DeepSeek-V2 write it: each head's features viewed
    as head_dim/2 complex numbers (``view_as_complex``), multiplied by ``freqs_cis``, and viewed
    back (``view_as_real``, ``flatten``)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))
        self.head = torch.nn.Linear(32, 64, bias=False)
        angles = torch.outer(torch.arange(64.0), 1.0 / 100.0 ** (torch.arange(4.0) / 4))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens):
        F = torch.nn.functional
        x = self.embed(tokens)
        b, s = tokens.size(0), tokens.size(1)
        freqs = self.freqs_cis[:s].unsqueeze(1)  # (s, 1, 4): broadcast over heads

        def rotate(t):
            t = torch.view_as_complex(t.view(b, s, 4, 8).reshape(b, s, 4, -1, 2))
            return torch.view_as_real(t * freqs).flatten(3).transpose(1, 2)

        q, k = rotate(self.q(x)), rotate(self.k(x))
        v = self.v(x).view(b, s, 4, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 32)
        return self.head(x + self.o(out))


def test_complex_rotary_splits_heads_and_keeps_the_pairs():
    torch.manual_seed(0)
    model = _ComplexRope()
    gm, ctx = _rewrite(model)
    assert decisions(gm).shards["model.q.weight"] == ParamShard(0, (4, 8), 0)  # by heads
    assert decisions(gm).shards["model.k.weight"] == ParamShard(0, (4, 8), 0)
    state = [*model.named_parameters(), *model.named_buffers()]
    load_local(gm, ctx, {f"model.{k}": v.detach() for k, v in state}, 0)
    seen = {}

    class Recorder(torch.fx.Interpreter):  # rank 0, without a TP group: collectives are identities
        def run_node(self, n):
            value = super().run_node(n)
            if n.meta.get("op") in ("view_as_complex", "view_as_real", "scaled_dot_product_attention"):
                seen.setdefault(n.meta["op"], []).append(tuple(value.shape))
            return value

    Recorder(gm).run(torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0)))  # rank 0's rows
    # 2 of 4 heads, each 4 complex numbers (8 features as pairs)
    assert seen == {
        "view_as_complex": [(2, 8, 2, 4)] * 2,
        "view_as_real": [(2, 8, 2, 4, 2)] * 2,
        "scaled_dot_product_attention": [(2, 2, 8, 8)],
    }


def _complex_worker(rank, world):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    torch.manual_seed(0)
    model = _ComplexRope()
    gm, ctx = _rewrite(model, tp=world)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = causal_lm_loss(model(tokens), tokens)
    state = [*model.named_parameters(), *model.named_buffers()]
    load_local(gm, ctx, {f"model.{k}": v.detach() for k, v in state}, rank)
    loss = gm(tokens)
    runtime.set_groups(tp=None)
    return abs(loss.item() - reference.item()) / abs(reference.item())


def test_complex_rotary_tp2_on_two_processes_matches_single_device():
    from distributed import run

    assert all(err < 1e-6 for err in run(_complex_worker, 2, timeout=120))


# ---------------------------------------------------------------------------------------------
# A per-head norm weight of shape (heads, head_dim), read through a cast (Cohere's q/k LayerNorm)


def test_per_head_norm_weight_is_split_with_its_heads():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CohereConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_qk_norm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    gm, ctx = _rewrite(transformers.CohereForCausalLM(cfg))
    shapes = {k: tuple(v.shape) for k, v in gm.named_parameters()}
    attn = "model.model.layers.0.self_attn"
    assert decisions(gm).shards[f"{attn}.q_norm.weight"] == ParamShard(0, (4,), 0)  # 4 heads, 2 a rank
    assert decisions(gm).shards[f"{attn}.k_norm.weight"] == ParamShard(0, (2,), 0)  # 2 key heads, 1 a rank
    assert (shapes[f"{attn}.q_norm.weight"], shapes[f"{attn}.k_norm.weight"]) == ((2, 16), (1, 16))
    assert f"{attn}.q_norm.weight" not in decisions(gm).partial_grads  # its heads are this rank's alone


# ---------------------------------------------------------------------------------------------
# Fewer key/value heads than the TP degree: each shared by tp/kv_heads ranks (Megatron's)


class _SharedKV(torch.nn.Module):
    """8 query heads, 2 key/value heads of 4 features; ``repeat`` writes the grouping out as
    transformers' repeat_kv does (expand and merge) instead of sdpa's enable_gqa."""

    def __init__(self, repeat: bool = False):
        super().__init__()
        self.repeat = repeat
        self.embed = torch.nn.Embedding(64, 32)
        self.q, self.o = torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False)
        self.k, self.v = torch.nn.Linear(32, 8, bias=True), torch.nn.Linear(32, 8, bias=False)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, tokens):
        F = torch.nn.functional
        x = self.embed(tokens)
        b, s = tokens.size(0), tokens.size(1)
        q = self.q(x).view(b, s, 8, 4).transpose(1, 2)
        k, v = (p(x).view(b, s, 2, 4).transpose(1, 2) for p in (self.k, self.v))
        if self.repeat:
            k, v = (t[:, :, None].expand(b, 2, 4, s, 4).reshape(b, 8, s, 4) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.repeat)
        return self.head(x + self.o(out.transpose(1, 2).reshape(b, s, 32)))


def _value_on_rank(gm, node, rank):
    """``node``'s value when ``gm`` runs as TP rank ``rank`` without a TP group (collectives are
    identities; the rank is patched in)."""
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            seen[n] = rank if n.target is runtime.tp_rank else super().run_node(n)
            return seen[n]

    Recorder(gm).run(torch.zeros(2, 8, dtype=torch.long))
    return seen[node]


def test_fewer_kv_heads_than_tp_each_rank_computes_its_query_heads_kv_head():
    torch.manual_seed(0)
    model = _SharedKV()
    gm, ctx = _rewrite(model, tp=4)
    load_local(gm, ctx, {f"model.{k}": v.detach() for k, v in model.state_dict().items()}, 3)
    assert decisions(gm).shards["model.q.weight"] == ParamShard(0, (8, 4), 0)  # 2 query heads a rank
    assert not {"model.k.weight", "model.k.bias", "model.v.weight"} & set(decisions(gm).shards)  # kept whole
    assert {"model.k.weight", "model.k.bias", "model.v.weight"} <= set(decisions(gm).partial_grads)
    cut = {n.args[0].target: n for n in gm.graph.nodes if n.target is torch.narrow}
    assert sorted(cut) == ["model.k.bias", "model.k.weight", "model.v.weight"]
    assert "each shared by 2 ranks" in notes(gm)[next(iter(cut["model.k.weight"].users)).name]
    # rank 3 holds query heads 6-7, which read key/value head 3 // (4 / 2) = 1: rows 4-7
    for name in cut:
        assert torch.equal(_value_on_rank(gm, cut[name], 3), model.get_parameter(name[6:])[4:8].detach())
    sdpa = next(n for n in gm.graph.nodes if n.meta.get("op") == "scaled_dot_product_attention")
    q, k, v = (_value_on_rank(gm, a, 3).shape for a in sdpa.args[:3])
    assert (q[1], k[1], v[1]) == (2, 1, 1)  # 2 of 8 query heads, 1 of 2 key/value heads


def test_shared_kv_heads_merged_with_their_repeats_are_refused_by_name():
    with pytest.raises(Refusal, match="merges key/value heads that TP ranks share with other dimensions"):
        _rewrite(_SharedKV(repeat=True), tp=4)


# ---------------------------------------------------------------------------------------------
# Heads merged with the batch, and an ALiBi bias over batch x heads (Bloom's attention)


class _Alibi(torch.nn.Module):
    """Bloom's attention: a fused QKV viewed (b, s, heads, 3, head_dim), q/k/v selected and
    merged with the batch (``b * heads``, a computed size), scores by ``baddbmm`` onto an ALiBi
    bias (a learnt per-head slope times the key position, made over b x heads outside the
    attention), ``bmm``, viewed back to (b, s, 32)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv, self.o = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25, 0.125, 0.0625]))

    def forward(self, tokens):
        b, s = tokens.size(0), tokens.size(1)
        x = self.embed(tokens)
        alibi = (self.slopes[:, None] * torch.arange(s)).repeat(b, 1).unsqueeze(1)  # (b * 4, 1, s)
        fused = self.qkv(x).view(b, s, 4, 3, 8)
        q, k, v = (fused.select(3, i).transpose(1, 2).reshape(b * 4, s, 8) for i in range(3))
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), alpha=8**-0.5).view(b, 4, s, s)
        probs = torch.softmax(scores + torch.ones(s, s).triu(1) * -1e4, dim=-1).view(b * 4, s, s)
        out = torch.bmm(probs, v).view(b, 4, s, 8).permute(0, 2, 1, 3).reshape(b, s, 32)
        return self.head(x + self.o(out))


def test_heads_merged_with_the_batch_split_and_the_alibi_bias_cut_to_the_ranks_heads():
    torch.manual_seed(0)
    model = _Alibi()
    gm, ctx = _rewrite(model)
    assert decisions(gm).shards["model.qkv.weight"] == ParamShard(0, (4, 3, 8), 0)  # by heads
    assert decisions(gm).shards["model.o.weight"] == ParamShard(1, (4, 8), 0)
    load_local(gm, ctx, {f"model.{k}": v.detach() for k, v in model.state_dict().items()}, 1)
    baddbmm = next(n for n in gm.graph.nodes if n.meta.get("op") == "baddbmm")
    bias, q = (_value_on_rank(gm, a, 1) for a in baddbmm.args[:2])
    assert q.shape == (2 * 2, 8, 8)  # batch 2 x this rank's 2 heads
    # rank 1 holds heads 2-3 of each batch row: their slopes times the key positions
    expected = (model.slopes[2:, None] * torch.arange(8)).repeat(2, 1).unsqueeze(1)
    assert torch.equal(bias, expected.detach())


def _alibi_worker(rank, world):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    torch.manual_seed(0)
    model = _Alibi()
    gm, ctx = _rewrite(model, tp=world)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = causal_lm_loss(model(tokens), tokens)
    reference.backward()
    load_local(gm, ctx, {f"model.{k}": v.detach() for k, v in model.state_dict().items()}, rank)
    loss = gm(tokens)
    loss.backward()
    worst = 0.0
    for name, p in gm.named_parameters():  # the slopes' gradient comes through the cut bias
        source = decisions(gm).origin.get(name, name)
        g = model.get_parameter(source.removeprefix("model.")).grad
        spec = decisions(gm).shards.get(source)
        g = slice_parameter(g, spec, rank, world) if spec else g
        worst = max(worst, (p.grad - g).abs().max().item() / (g.abs().max().item() + 1e-12))
    runtime.set_groups(tp=None)
    return abs(loss.item() - reference.item()) / abs(reference.item()), worst


def test_alibi_attention_tp2_on_two_processes_matches_single_device():
    from distributed import run

    for loss_err, grad_err in run(_alibi_worker, 2, timeout=120):
        assert loss_err < 1e-5
        assert grad_err < 1e-5

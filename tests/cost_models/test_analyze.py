"""The cost model against numbers worked by hand from published formulas."""

import pytest
import torch

from autoshard import ir

from conftest import captured

# GPT-3 175B layer (Korthikanti et al. 2022, Table 2): s=2048, b=1, h=12288, a=96, 16-bit.
S, BATCH, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * BATCH * H


@pytest.fixture(scope="module")
def gpt3_layer():
    _, cost = captured("gpt", "175b", S)
    return cost.blocks[0]


@pytest.mark.parametrize(
    "tp,sp,recompute,expected",
    [
        (1, False, set(), SBH * (34 + 5 * A * S / H)),
        (T, False, set(), SBH * (10 + 24 / T + 5 * A * S / (H * T))),
        (T, True, set(), SBH * (34 / T + 5 * A * S / (H * T))),
        (T, False, {"attention"}, SBH * (10 + 24 / T)),
        (T, True, {"attention"}, SBH * 34 / T),
    ],
    ids=["none", "tp", "tp+sp", "tp+selective", "tp+sp+selective"],
)
def test_activation_memory_matches_korthikanti(gpt3_layer, tp, sp, recompute, expected):
    got = gpt3_layer.activation_bytes(BATCH, S, tp=tp, sp=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=0.05)


def test_full_recompute_keeps_only_layer_input_and_costs_one_forward(gpt3_layer):
    everything = set(gpt3_layer.categories)
    assert gpt3_layer.activation_bytes(BATCH, S, recompute=everything) == pytest.approx(2 * SBH)
    fwd = gpt3_layer.eval("flops", BATCH, S)
    extra = gpt3_layer.recompute_fn(everything)(BATCH, S)
    assert extra / (3 * fwd) == pytest.approx(1 / 3, rel=0.01)  # "full recompute about 33%"


def test_selective_recompute_reruns_only_the_attention_core(gpt3_layer):
    extra = gpt3_layer.recompute_fn({"attention"})(BATCH, S)
    qk = 2 * BATCH * S * S * H  # the QK^T product; softmax and dropout are pointwise
    assert qk < extra < 1.1 * qk


def test_gpt3_flops_match_megatron_formula():
    _, cost = captured("gpt", "175b", S)
    v, L = 50257, 96
    per_token = 72 * L * H * H * (1 + S / (6 * H) + v / (12 * H * L))  # 72BLsh^2(...)/(Bs)
    assert cost.flops_per_token(S)["training"] == pytest.approx(per_token, rel=0.01)


def test_parameter_counts():
    assert captured("gpt", "175b", S)[1].params == pytest.approx(175e9, rel=0.01)
    assert captured("llama3", "405b", 8192)[1].params == pytest.approx(405.8e9, rel=0.001)
    assert captured("deepseek_v3", "671b", 4096)[1].params == pytest.approx(671e9, rel=0.001)


def test_training_flops_per_token_match_deepseek_isca_figures():
    # DeepSeek ISCA paper (arXiv 2505.09343): 2,448 GFLOPs/token for LLaMA-405B and 250 for V3 at 4K.
    llama = captured("llama3", "405b", 4096)[1].flops_per_token(4096)["training"]
    ds = captured("deepseek_v3", "671b", 4096)[1].flops_per_token(4096)["training"]
    assert llama == pytest.approx(2448e9, rel=0.03)
    assert ds == pytest.approx(250e9, rel=0.03)


def test_tensor_parallel_structure_from_the_graph():
    cap, cost = captured("llama3", "405b", 8192)
    roles = {n.meta["module_path"]: n.meta.get("tp_role") for n in cap.layer_nodes[0] if "tp_role" in n.meta}
    assert roles == {
        "layers.0.attn.wq": "column",
        "layers.0.attn.wk": "column",
        "layers.0.attn.wv": "column",
        "layers.0.attn.wo": "row",
        "layers.0.ffn.w1": "column",
        "layers.0.ffn.w3": "column",
        "layers.0.ffn.w2": "row",
    }
    blk = cost.blocks[0]
    assert blk.params - blk.params_tp == 2 * 16384  # only the two norm weights stay replicated
    tp_volumes = sorted(str(c.elems) for c in blk.collectives if c.axis == "tp")
    assert tp_volumes == ["16384*b*s"] * 4  # 2 all-reduces forward, 2 backward (Megatron f/g)


def test_deepseek_latent_projections_stay_replicated_and_experts_use_expert_parallelism():
    cap, cost = captured("deepseek_v3", "671b", 4096)
    moe = cost.blocks[1]
    roles = {
        n.meta["module_path"].split(".", 2)[2]: n.meta.get("tp_role") for n in cap.layer_nodes[3] if "tp_role" in n.meta
    }
    assert roles["attn.wq_a"] == "replicated" and roles["attn.wkv_a"] == "replicated"  # feed a norm
    assert roles["attn.wq_b"] == "column" and roles["attn.wo"] == "row"
    assert roles["ffn.gate"] == "replicated"
    assert moe.params_experts == 256 * 3 * 7168 * 2048
    # one dispatch per MoE layer (the cost model prices its combine, the same size, with it): the
    # (experts, capacity, hidden) buffer: at capacity factor 1, the tokens' 8 choices each
    dispatch = [c for c in moe.collectives if c.axis == "ep"]
    assert len(dispatch) == 1 and dispatch[0].elems.subs({ir.B: 1, ir.S: 4096}) == 8 * 4096 * 7168


# ---------------------------------------------------------------------------------------------
# Facts read off the graph however the model writes its layers


class _Layer(torch.nn.Module):
    """Attention written as transformers writes it: K/V of ``kv_heads`` heads repeated to the
    query heads (``repeat_kv``: unsqueeze, expand, reshape), the fused QKV projection as GPT-2's
    Conv1D (``addmm(bias, x, weight)``, the weight stored (in, out))."""

    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        out = (heads + 2 * kv_heads) * self.dim
        self.weight = torch.nn.Parameter(torch.randn(hidden, out) / 8)
        self.bias = torch.nn.Parameter(torch.zeros(out))

    def forward(self, x, rotary):
        b, s = x.size(0), x.size(1)
        qkv = torch.addmm(self.bias, x.reshape(b * s, -1), self.weight).view(b, s, -1, self.dim)
        q, k, v = qkv.transpose(1, 2).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q = q * rotary
        rep = self.heads // self.kv_heads
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.dim).reshape(b, self.heads, s, self.dim)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.dim).reshape(b, self.heads, s, self.dim)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + out.transpose(1, 2).reshape(b, s, -1)


class _Decoder(torch.nn.Module):
    """Layers of :class:`_Layer` after a rotary table of the head width made before them (the
    last thing the embedding region hands on, narrower than the residual stream)."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(64, hidden)
        self.layers = torch.nn.ModuleList(_Layer(hidden, heads, kv_heads) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 64, bias=False)
        self.dim = hidden // heads

    def forward(self, tokens):
        x = self.embed(tokens)
        angles = torch.arange(tokens.size(1), device=tokens.device)[:, None] * torch.ones(self.dim // 2)
        rotary = torch.cat([angles.cos(), angles.sin()], -1)
        for layer in self.layers:
            x = layer(x, rotary)
        return self.head(x)


def test_facts_of_repeated_keys_a_narrow_rotary_table_and_addmm_projections():
    from autoshard.capture import capture
    from autoshard.cost_models.analyze import analyze

    cost = analyze(capture(_Decoder(), (torch.zeros(2, 8, dtype=torch.long),)))
    facts = cost.facts
    assert (facts["heads"], facts["kv_heads"], facts["hidden"]) == ([4], [2], 32)  # not 4 kv heads, not 4 wide
    (qkv,) = [g for g in cost.blocks[0].gemms]
    assert (qkv.n, qkv.k) == (64, 32)  # addmm(bias, x, w): contracts x's 32, not the bias's 64


class _MultiQueryLayer(torch.nn.Module):
    """Multi-query attention, 4 query heads and one key and value head of 8 features: through a
    fused projection, split off its output viewed into heads, as Falcon writes it, or through
    projections of their own."""

    def __init__(self, fused: bool, hidden=32, heads=4):
        super().__init__()
        self.fused, self.heads, self.dim = fused, heads, hidden // heads
        if fused:
            self.qkv = torch.nn.Linear(hidden, (heads + 2) * self.dim, bias=False)
        else:
            self.q = torch.nn.Linear(hidden, hidden, bias=False)
            self.k, self.v = (torch.nn.Linear(hidden, self.dim, bias=False) for _ in range(2))
        self.dense = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, rotary):  # the decoder's rotary table, unused
        b, s = x.size(0), x.size(1)
        if self.fused:
            q, k, v = self.qkv(x).view(b, s, -1, self.dim).split([self.heads, 1, 1], dim=2)
        else:
            q, k, v = (p(x).view(b, s, -1, self.dim) for p in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return x + self.dense(out.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "own-projections"])
def test_one_key_value_head_costs_whole_on_every_tp_rank(fused):
    """What the tensor-parallel pass does with it: the key and value head's weights whole on
    every rank, and the head computed whole, the query heads split; the cost model says the same."""
    from autoshard.capture import capture
    from autoshard.cost_models.analyze import analyze
    from autoshard.passes.contract import RewriteContext, decisions
    from autoshard.passes.tensor_parallel import tensor_parallel

    model = _Decoder()
    model.layers = torch.nn.ModuleList(_MultiQueryLayer(fused) for _ in range(2))
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    cost = analyze(cap)
    assert cost.facts["kv_heads"] == [1] and 1 not in cost.facts["tp_dims"]  # no bound on TP
    blk = cost.blocks[0]
    projections = sorted((g.n, g.role) for g in blk.gemms if g.k == 32 and g.role != "row")
    whole = [(16, "replicated")] if fused else [(8, "replicated")] * 2
    assert projections == sorted([(32, "column"), *whole])  # the key and value head not divided
    assert blk.params - blk.params_tp == (48 if fused else 16) * 32  # their weights stay whole
    assert blk.matmul[2].subs({ir.B: 2, ir.S: 8}) == 2 * 16 * 16 * 32  # computed whole
    gm = tensor_parallel(cap.graph_module, RewriteContext(tp=2))
    held = {k: tuple(v.shape) for k, v in gm.named_parameters() if k.startswith("model.layers.0.")}
    if fused:  # the program's rows of the weight, as the gemms say
        (rows,) = [n.meta["shape"][0] for n in gm.graph.nodes if n.target is torch.cat and n.meta.get("layer") == 0]
        assert rows == 32 // 2 + 16 and held["model.layers.0.qkv.weight"] == (48, 32)
    else:
        assert held["model.layers.0.q.weight"] == (16, 32) and held["model.layers.0.k.weight"] == (8, 32)
    assert sum(n.startswith("model.layers.0.") for n in decisions(gm).partial_grads) == (1 if fused else 2)


class _SharedKVLayer(torch.nn.Module):
    """8 query heads of 4 features, 2 key/value heads: above TP2 each is shared by tp/2 ranks."""

    def __init__(self):
        super().__init__()
        self.q, self.o = torch.nn.Linear(32, 32, bias=False), torch.nn.Linear(32, 32, bias=False)
        self.k, self.v = torch.nn.Linear(32, 8, bias=False), torch.nn.Linear(32, 8, bias=False)

    def forward(self, x, rotary):  # the decoder's rotary table, unused
        b, s = x.size(0), x.size(1)
        q, k, v = (p(x).view(b, s, -1, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


def test_fewer_key_value_heads_than_tp_cost_what_the_pass_does():
    """TP4 over 2 key/value heads: the degree is a choice, each rank computes one of the key/value
    heads (half the projection, not a quarter) from their weights held whole, as the program does."""
    from types import SimpleNamespace

    from autoshard.capture import capture
    from autoshard.cost_models.analyze import analyze
    from autoshard.passes.contract import RewriteContext
    from autoshard.passes.tensor_parallel import tensor_parallel
    from autoshard.planner.candidates import tp_choices

    model = _Decoder()
    model.layers = torch.nn.ModuleList(_SharedKVLayer() for _ in range(2))
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    cost = analyze(cap)
    assert cost.facts["kv_heads"] == [2]
    assert tp_choices(SimpleNamespace(cost=cost, gpus=8)) == [1, 2, 4, 8]  # 8: one query head a rank
    kv = [g for g in cost.blocks[0].gemms if g.role == "column" and g.n == 8]
    assert [(g.heads, g.out_split(4), g.weight_split(4), g.weight_split(2)) for g in kv] == [(2, 2, 1, 2)] * 2
    gm = tensor_parallel(cap.graph_module, RewriteContext(tp=4))
    held = {k: tuple(v.shape) for k, v in gm.named_parameters() if k.startswith("model.layers.0.")}
    assert held["model.layers.0.k.weight"] == (8, 32) and held["model.layers.0.q.weight"] == (8, 32)
    rows = [n.meta["shape"][0] for n in gm.graph.nodes if n.target is torch.narrow and n.meta.get("layer") == 0]
    assert rows == [8 // 2] * 2  # the projection's output over out_split(4), as the gemms say


class _WholeAttentionLayer(torch.nn.Module):
    """Attention whose fused QKV output is normalised over all its features, which no TP split
    can run: the projection and the attention after it stay whole on every TP rank."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.norm = torch.nn.LayerNorm(3 * hidden)
        self.dense = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, rotary):  # the decoder's rotary table, unused
        b, s = x.size(0), x.size(1)
        q, k, v = self.norm(self.qkv(x)).view(b, s, 3 * self.heads, self.dim).transpose(1, 2).chunk(3, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.dense(out.transpose(1, 2).reshape(b, s, -1))


def test_attention_tp_leaves_whole_costs_whole_on_every_tp_rank():
    from autoshard.capture import capture
    from autoshard.cost_models import hardware
    from autoshard.cost_models.analyze import analyze
    from autoshard.cost_models.layers import LayerCosts

    model = _Decoder()
    model.layers = torch.nn.ModuleList(_WholeAttentionLayer() for _ in range(2))
    cost = analyze(capture(model, (torch.zeros(2, 8, dtype=torch.long),)))
    blk = cost.blocks[0]
    assert [g.role for g in blk.gemms if g.n == 96] == ["replicated"]  # the QKV projection
    core = blk.eval("flops_attention", 2, 64)
    assert core > 0 and blk.eval("flops_attention_whole", 2, 64) == core
    costs = LayerCosts(cost, 64, hardware.load("h100"), False)
    forward = {tp: costs.matmul_flops(0, 2, tp, 1, frozenset())[0] for tp in (1, 2)}
    divided = float(blk._compiled["matmul"][1](2, 64))  # the layer's products TP divides
    assert forward[1] - forward[2] == pytest.approx(divided / 2)  # its attention not among them
    assert costs._rest(0, 2, 2, 1)[0] == costs._rest(0, 2, 1, 1)[0]  # nor in the attention's time

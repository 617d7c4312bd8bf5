"""Canonicalize: torch.export's guards, metadata asserts and meta-device constants go; the device of
the first input takes the constants' place; a graph that is already canonical is left alone."""

import operator

import pytest
import torch
from torch import fx, nn

from autoshard.capture import capture, causal_lm_loss
from autoshard.capture.trace import trace
from autoshard.passes._graph import upstream
from autoshard.passes.canonicalize import canonicalize
from autoshard.passes.moe_forms import batched_experts, expert_loops
from autoshard.runtime import moe

from graphs import TINY_DECODER, TinyLM, listing, loss, tokens

META = torch.device("meta")


class _Guards(nn.Module):
    def forward(self, x):
        pass


def _before() -> fx.GraphModule:
    """What torch.export gives for ``x + arange(x.size(1))`` traced on meta."""
    g = fx.Graph()
    x = g.placeholder("x")
    g.call_module("_guards_fn", (x,))
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 1))
    g.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32, "device": META})
    positions = g.call_function(torch.ops.aten.arange.default, (size,), {"device": META, "pin_memory": False})
    moved = g.call_function(torch.ops.aten.to.dtype_layout, (positions,), {"dtype": torch.float32, "device": META})
    g.output(g.call_function(operator.add, (x, moved)))
    root = nn.Module()
    root._guards_fn = _Guards()
    return fx.GraphModule(root, g)


def _expected() -> fx.Graph:
    g = fx.Graph()
    x = g.placeholder("x")
    device = g.call_function(getattr, (x, "device"))
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 1))
    positions = g.call_function(torch.ops.aten.arange.default, (size,), {"device": device, "pin_memory": False})
    moved = g.call_function(torch.ops.aten.to.dtype_layout, (positions,), {"dtype": torch.float32, "device": device})
    g.output(g.call_function(operator.add, (x, moved)))
    return g


def test_export_artefacts_go_and_the_inputs_device_replaces_meta():
    gm = _before()
    out = canonicalize(gm)
    assert out is gm
    assert listing(gm.graph) == listing(_expected())
    assert not hasattr(gm, "_guards_fn")


def test_the_canonical_graph_runs_where_its_inputs_are():
    x = torch.randn(2, 5)
    with pytest.raises(RuntimeError):  # the traced graph makes its positions on meta
        _before()(x)
    gm = canonicalize(_before())
    assert torch.equal(gm(x), x + torch.arange(5.0))


def test_a_canonical_graph_is_left_unchanged():
    gm, tracer, _ = trace(TinyLM(2), (tokens(),), loss)
    assert tracer == "symbolic_trace"
    before = listing(gm.graph)
    assert listing(canonicalize(gm).graph) == before


def test_capture_hands_on_the_canonical_graph():
    """A device fixed in the model (as export records one) is read off the input after capture, and
    the captured graph computes the model's loss on CPU."""
    torch.manual_seed(0)
    model = TinyLM(2, device=META)
    cap = capture(model, (tokens(),), loss=loss)
    nodes = list(cap.graph_module.graph.nodes)
    (device,) = [n for n in nodes if n.target is getattr]
    assert device.args == (nodes[0], "device")
    zeros = [n for n in nodes if n.target is torch.zeros]
    assert len(zeros) == 2 and all(n.kwargs["device"] is device for n in zeros)
    for block in model.layers:
        block.device = None  # the same model without the fixed device
    assert torch.allclose(cap.graph_module(tokens()), loss(model(tokens()), tokens()))


def test_export_path_graphs_carry_no_artefacts():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**TINY_DECODER)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    cap = capture(model, seq=32)
    assert cap.tracer == "export"
    nodes = list(cap.graph_module.graph.nodes)
    names = [getattr(n.target, "__name__", str(n.target)) for n in nodes]
    assert not [n for n in names if n.startswith(("_assert_tensor_metadata", "_guards_fn"))]
    assert not hasattr(cap.graph_module, "_guards_fn")
    meta = [n for n in nodes if META in (*n.args, *n.kwargs.values())]
    assert not meta
    (device,) = [n for n in nodes if n.target is getattr and n.args[1:] == ("device",)]
    (first_input, *_) = [n for n in nodes if n.op == "placeholder"]
    assert device.args[0] is first_input and device.meta["region"] == "pre"
    assert len(device.users) >= 2  # the positions' arange and the casts (nodes nothing reads are gone)


# ---------------------------------------------------------------------------------------------
# Causal masks: a mask tensor computed from positions becomes is_causal where it is causal


class MaskedAttention(nn.Module):
    """Attention whose mask is built from positions, as transformers builds it: key position <=
    query position (plus ``ahead``), and within ``window`` positions when one is given; ``additive`` turns it
    into 0 / lowest-float, as eager attention adds it; ``padding`` also hides the keys the
    second input marks 0 (or, with ``documents``, the keys whose document id there differs from
    the query's)."""

    def __init__(self, window: int | None = None, additive: bool = False, ahead: int = 0, documents: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24, bias=False)
        self.head = nn.Linear(8, 16, bias=False)
        self.window, self.additive, self.ahead, self.documents = window, additive, ahead, documents

    def forward(self, tokens, padding=None):
        b, s = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        position = torch.arange(s, device=tokens.device)
        query, key = position[:, None], position[None, :]
        mask = key <= query + self.ahead
        if self.window is not None:
            mask = mask & (key > query - self.window)
        mask = mask[None, None].expand(b, 1, s, s)
        if padding is not None and self.documents:
            mask = mask & (padding[:, None, :, None] == padding[:, None, None, :])
        elif padding is not None:
            mask = mask & padding[:, None, None, :].bool()
        if self.additive:
            mask = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(out.transpose(1, 2).reshape(b, s, 8))


def _attention(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention]


def _loss(logits, tokens, *_):
    return loss(logits, tokens)


def _canonical(model, seq: int = 6, *inputs):
    inputs = (tokens(seq=seq), *inputs)
    gm, tracer, _ = trace(model, inputs, _loss)
    assert tracer == "symbolic_trace"
    return canonicalize(gm, inputs), inputs


def test_a_mask_too_large_at_the_traced_length_is_judged_at_two_shorter_ones(monkeypatch):
    """A long context: the mask is built at two shorter lengths, long enough for its integers (a
    window) to show, and is causal only where it is causal at both; where its integers need as
    many tokens as were traced, it stays, saying so."""
    from autoshard.passes import canonicalize as module

    monkeypatch.setattr(module, "MASK_LIMIT", 1 << 16)  # bytes: a 2 x 400 x 400 boolean mask is larger
    gm, inputs = _canonical(MaskedAttention(), seq=400)
    assert _attention(gm)[0].kwargs == {"is_causal": True}
    model = MaskedAttention(window=20)
    gm, inputs = _canonical(model, seq=400)
    assert _attention(gm)[0].meta["mask"].what == "sliding-window attention (window 20)"
    assert torch.allclose(gm(*inputs), loss(model(*inputs), inputs[0]), atol=1e-6)
    gm, _ = _canonical(MaskedAttention(window=300), seq=400)
    assert _attention(gm)[0].meta["mask"].what == (
        "a mask tensor too large to check at the traced sizes (its integers need 602 tokens of the 400 traced)"
    )


@pytest.mark.parametrize("additive", [False, True], ids=["boolean", "additive"])
def test_a_causal_mask_becomes_is_causal_and_its_nodes_go(additive):
    torch.manual_seed(0)
    model = MaskedAttention(additive=additive)
    gm, inputs = _canonical(model)
    (attention,) = _attention(gm)
    assert attention.args[3:] == () and attention.kwargs == {"is_causal": True}
    assert "mask" not in attention.meta
    made = {getattr(n.target, "__name__", n.target) for n in gm.graph.nodes}
    assert not made & {"le", "gt", "and_", "where", "arange", "expand"}  # the mask's nodes are gone
    assert torch.allclose(gm(*inputs), loss(model(*inputs), inputs[0]), atol=1e-6)


def test_a_window_wider_than_the_traced_sequence_is_causal_there_and_not_at_a_longer_one():
    gm, _ = _canonical(MaskedAttention(window=8), seq=6)
    assert _attention(gm)[0].kwargs == {"is_causal": True}
    gm, inputs = _canonical(MaskedAttention(window=8), seq=12)
    (attention,) = _attention(gm)
    assert attention.meta["mask"].what == "sliding-window attention (window 8)"
    assert (attention.meta["mask"].kind, attention.meta["mask"].window) == ("sliding_window", 8)
    assert "is_causal" not in attention.kwargs and isinstance(attention.kwargs["attn_mask"], fx.Node)


def test_a_mask_read_from_an_input_is_not_causal():
    model = MaskedAttention()
    padding = torch.ones(2, 6, dtype=torch.long)  # all ones: causal on this data, not on others
    gm, inputs = _canonical(model, 6, padding)
    (attention,) = _attention(gm)
    assert attention.meta["mask"].what == "a mask computed from the input 'padding' (padding or document masking)"
    assert attention.meta["mask"].kind == "padding"
    assert torch.allclose(gm(*inputs), loss(model(*inputs), inputs[0]), atol=1e-6)


def test_a_mask_comparing_document_ids_is_document_masking():
    """Per-token document ids compared with themselves (query's == key's): a document mask."""
    model = MaskedAttention(documents=True)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
    gm, inputs = _canonical(model, 6, documents)
    (attention,) = _attention(gm)
    assert attention.meta["mask"].kind == "document"
    assert attention.meta["mask"].what == "document masking (a mask comparing the input 'padding' with itself)"
    assert torch.allclose(gm(*inputs), loss(model(*inputs), inputs[0]), atol=1e-6)


class ALiBi(MaskedAttention):
    """Written-out attention with ALiBi: a slope per head times the key position added to the
    scores (by ``baddbmm``, as Bloom adds it, or by ``+``), then a causal additive mask."""

    def __init__(self, baddbmm: bool):
        super().__init__()
        self.baddbmm = baddbmm

    def forward(self, tokens):
        b, s = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        slopes = 2.0 ** -torch.arange(1, 3, device=tokens.device)
        bias = (slopes[:, None] * torch.arange(s, device=tokens.device))[None, :, None, :].expand(b, 2, 1, s)
        q, k, bias = q.reshape(b * 2, s, 4), k.reshape(b * 2, s, 4), bias.reshape(b * 2, 1, s)
        if self.baddbmm:
            scores = bias.baddbmm(q, k.transpose(1, 2), alpha=0.5)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)) * 0.5 + bias
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        scores = scores.view(b, 2, s, s) + torch.where(causal, 0.0, torch.finfo(torch.float32).min)
        out = torch.softmax(scores, dim=-1) @ v
        return self.head(out.transpose(1, 2).reshape(b, s, 8))


def _softmax(model) -> fx.Node:
    """The one softmax of ``model`` traced at 6 tokens and canonicalized (whichever tracer)."""
    inputs = (tokens(seq=6),)
    gm = canonicalize(trace(model, inputs, _loss)[0], inputs)
    (softmax,) = [n for n in gm.graph.nodes if "softmax" in str(n.target)]
    return softmax


@pytest.mark.parametrize("baddbmm", [True, False], ids=["baddbmm", "add"])
def test_alibi_on_written_out_scores_is_named_on_their_softmax(baddbmm):
    softmax = _softmax(ALiBi(baddbmm))
    assert softmax.meta["mask"].kind == "positional_bias"
    assert softmax.meta["mask"].what.startswith("ALiBi")


class MaskedFill(MaskedAttention):
    """Written-out attention whose scores ``masked_fill`` hides: the later positions (causal),
    and those ``window`` or more back where given."""

    def forward(self, tokens):
        b, s = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        ones = torch.ones(s, s, dtype=torch.bool, device=tokens.device)
        hidden = ones.triu(1) if self.window is None else ones.triu(1) | ones.tril(-self.window)
        scores = (q @ k.transpose(-2, -1)).masked_fill(hidden, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.head(out.transpose(1, 2).reshape(b, s, 8))


def test_masked_fill_hides_what_its_mask_marks():
    """``masked_fill``'s mask marks the hidden positions: a causal one leaves the softmax
    unmarked, a band marks it a sliding window."""
    assert "mask" not in _softmax(MaskedFill()).meta
    softmax = _softmax(MaskedFill(window=3))
    assert (softmax.meta["mask"].kind, softmax.meta["mask"].window) == ("sliding_window", 3)


def test_a_mask_that_sees_later_positions_or_comes_from_a_parameter_stays():
    class Learned(MaskedAttention):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(6, 6))

        def forward(self, tokens):
            b, s = tokens.size(0), tokens.size(1)
            q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
            return self.head(out.transpose(1, 2).reshape(b, s, 8))

    model = Learned()
    gm, _ = _canonical(model)
    assert _attention(gm)[0].meta["mask"].what == "a mask computed from the parameter 'model.bias'"
    gm, _ = _canonical(MaskedAttention(ahead=1))
    assert _attention(gm)[0].meta["mask"].what == "a mask that lets positions attend to later ones (not causal)"


def test_a_mask_too_large_to_evaluate_stays(monkeypatch):
    from autoshard.passes import canonicalize as module

    monkeypatch.setattr(module, "MASK_LIMIT", 16)  # bytes: the 6 x 6 mask is larger
    gm, _ = _canonical(MaskedAttention())
    assert _attention(gm)[0].meta["mask"].what.startswith("a mask tensor too large to check at the traced sizes")


@pytest.mark.parametrize(
    ("config", "extra", "mask"),
    [
        ("LlamaConfig", {}, None),
        ("Qwen3Config", {"head_dim": 16}, None),
        ("MistralConfig", {"sliding_window": 16}, "sliding-window attention (window 16)"),
        ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 256}, None),  # wider than the 32 traced
    ],
    ids=["llama", "qwen3", "mistral-window-16", "gemma3-window-256"],
)
@pytest.mark.parametrize("long", [False, True], ids=["checked-whole", "too-large-whole"])
def test_transformers_masks_and_grouped_keys(config, extra, mask, long, monkeypatch):
    """transformers builds its causal mask from positions (and sliding layers' windows); capture
    at 32 tokens sees causal attention where the mask is causal at 32 tokens, and the keys and
    values repeat_kv copied per query head as the grouped heads they are. ``long``: at 512 tokens,
    with masks of that length too large to build (as at 131K), the verdicts are the same (Gemma 3's
    window narrowed to 48 so that it shows within 512)."""
    transformers = pytest.importorskip("transformers")
    if long:
        from autoshard.passes import canonicalize as module

        monkeypatch.setattr(module, "MASK_LIMIT", 1 << 18)  # bytes: a 2 x 512 x 512 mask is larger
        if config.startswith("Gemma3"):
            extra, mask = {**extra, "sliding_window": 48}, "sliding-window attention (window 48)"
    torch.manual_seed(0)
    model = getattr(transformers, config.replace("Config", "ForCausalLM").replace("TextForCausalLM", "ForCausalLM"))(
        getattr(transformers, config)(**TINY_DECODER, **extra)
    )
    ids = torch.randint(0, 128, (2, 512 if long else 32), generator=torch.Generator().manual_seed(0))
    cap = capture(model, (ids,))
    attention = [n for n in cap.graph_module.graph.nodes if n.meta["op"] == "scaled_dot_product_attention"]
    assert len(attention) == 2
    # repeat_kv's copies are gone: attention reads the 2 key/value heads, grouped
    assert all(n.kwargs["enable_gqa"] is True and n.args[1].meta["shape"][1] == 2 for n in attention)
    if mask is None:
        assert all(n.kwargs.get("is_causal") is True and len(n.args) == 3 for n in attention)
        read = set().union(*(upstream(n) for n in attention))
        assert not [n for n in read if n.meta["op"] in ("cumsum", "diff", "index", "le")]  # no mask reaches it
    else:
        assert [n.meta["mask"].what if n.meta.get("mask") else None for n in attention] == [mask, mask]
    logits = model(ids, use_cache=False).logits
    assert torch.allclose(cap.graph_module(ids), causal_lm_loss(logits, ids), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# RMS norms written out op by op become one rms_norm

aten = torch.ops.aten
EPS = 1e-6


def _with_values(gm: fx.GraphModule, *shapes) -> fx.GraphModule:
    """Record each node's value as torch.export does (``meta["val"]``)."""

    class _Record(fx.Interpreter):
        def run_node(self, n):
            n.meta["val"] = super().run_node(n)
            return n.meta["val"]

    _Record(gm).run(*(torch.randn(s) for s in shapes))
    return gm


def _norm_graph(dim=-1, root=aten.rsqrt.default, gemma=False, project=False, weight=True) -> fx.GraphModule:
    """transformers' RMSNorm as export writes it (upcast, pow, mean, + eps, rsqrt, multiply, cast,
    scale), with one thing changed per argument: the dim of the mean, the op in place of rsqrt,
    Gemma's ``(1 + w)`` scale before the cast, a projection's output as the normalised input,
    no scale."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("weight") if weight or gemma else None
    if project:
        x = g.call_function(aten.linear.default, (x, g.get_attr("proj")))
    up = g.call_function(aten.to.dtype, (x, torch.float32))
    mean = g.call_function(aten.mean.dim, (g.call_function(aten.pow.Tensor_Scalar, (up, 2)), [dim], True))
    rooted = g.call_function(root, (g.call_function(aten.add.Tensor, (mean, EPS)),))
    normed = g.call_function(aten.mul.Tensor, (up, rooted))
    if gemma:
        scale = g.call_function(aten.add.Tensor, (g.call_function(aten.to.dtype, (w, torch.float32)), 1.0))
        out = g.call_function(aten.type_as.default, (g.call_function(aten.mul.Tensor, (normed, scale)), up))
    else:
        out = g.call_function(aten.to.dtype, (normed, torch.float32))
        out = g.call_function(aten.mul.Tensor, (w, out)) if weight else out
    g.output(g.call_function(aten.add.Tensor, (out, x)))  # the residual reads x after the norm
    root_module = nn.Module()
    root_module.weight = nn.Parameter(torch.randn(8))
    root_module.proj = nn.Parameter(torch.randn(8, 8))
    return _with_values(fx.GraphModule(root_module, g), (2, 5, 8))


def _fused_graph(gemma=False, weight=True) -> fx.Graph:
    """The fused norm reads the tensor before the norm's own upcast (it computes in fp32 and keeps
    its input's dtype), but where the upcast is read besides (Gemma's ``type_as(.., up)``)."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("weight") if weight else None
    up = g.call_function(aten.to.dtype, (x, torch.float32)) if gemma else x
    if gemma:
        w = g.call_function(aten.add.Tensor, (g.call_function(aten.to.dtype, (w, torch.float32)), 1.0))
    out = g.call_function(aten.rms_norm.default, (up, [8], w, EPS))
    g.output(g.call_function(aten.add.Tensor, (out, x)))
    return g


@pytest.mark.parametrize(
    "form", [{}, {"gemma": True}, {"weight": False}], ids=["llama-scale", "gemma-one-plus-w", "no-scale"]
)
def test_a_written_out_rms_norm_becomes_one_rms_norm_of_the_same_values(form):
    before = _norm_graph(**form)
    x = torch.randn(2, 5, 8)
    expected = before(x)
    gm = canonicalize(before)
    graph = gm.graph
    assert listing(graph) == listing(_fused_graph(**form))
    (fused,) = [n for n in graph.nodes if n.target is aten.rms_norm.default]
    assert tuple(fused.meta["val"].shape) == (2, 5, 8)  # the meta of the node it replaced
    assert torch.allclose(gm(x), expected, atol=1e-6)


@pytest.mark.parametrize(
    "miss",
    [{"dim": 1}, {"root": aten.sqrt.default}, {"project": True}],
    ids=["mean-over-another-dim", "sqrt-not-rsqrt", "over-a-projections-features"],
)
def test_what_is_not_an_rms_norm_or_is_over_a_projections_features_stays_written_out(miss):
    gm = _norm_graph(**miss)
    before = listing(gm.graph)
    assert listing(canonicalize(gm).graph) == before


def test_a_copy_of_a_model_input_to_what_it_already_is_goes():
    """``input_ids.to(device)`` (as Llama 4 writes it) reads the input itself afterwards, so the loss
    and every pipeline chunk read the model's input; a copy that changes the dtype stays."""
    g = fx.Graph()
    ids = g.placeholder("ids")
    device = g.call_function(getattr, (ids, "device"))
    same = g.call_function(torch.ops.aten.to.dtype_layout, (ids,), {"dtype": torch.long, "device": device})
    other = g.call_function(torch.ops.aten.to.dtype, (ids, torch.float32))
    g.output((same, other))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert canonicalize(gm, (torch.zeros(2, 4, dtype=torch.long),)) is gm
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0][0] is ids and out.args[0][1] is other
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(torch.ops.aten.to.dtype) == 1


class BufferMasked(nn.Module):
    """nanoGPT's attention: the causal mask a registered buffer of ``tril(ones)`` (less the band
    below ``window``, for a sliding window), sliced to the sequence and applied with
    ``masked_fill(..., -inf)`` before a written-out softmax."""

    def __init__(self, block: int = 16, window: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24, bias=False)
        self.head = nn.Linear(8, 16, bias=False)
        ones = torch.ones(block, block)
        kept = torch.tril(ones) if window is None else torch.tril(ones) - torch.tril(ones, -window)
        self.register_buffer("bias", kept.view(1, 1, block, block))

    def forward(self, tokens):
        b, t = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(self.embed(tokens)).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        att = (q @ k.transpose(-2, -1)) * 0.5
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        out = torch.softmax(att, dim=-1) @ v
        return self.head(out.transpose(1, 2).reshape(b, t, 8))


@pytest.mark.parametrize(
    "window,recorded,kind",
    [(None, True, None), (3, True, "sliding_window"), (None, False, "buffer")],
    ids=["causal", "window-3", "not-recorded"],
)
def test_a_mask_kept_in_a_buffer_built_on_meta_is_judged_by_its_recorded_initialisation(window, recorded, kind):
    """The buffer has no values on meta; its recorded initialisation gives them: a causal one
    marks the masked_fill causal, and the flash pass fuses the written-out attention, keeping the
    read of the buffer (part of the model's state); a sliding window is what it is; without a
    recorded initialisation the mask stays a buffer's, not known causal."""
    from autoshard import runtime
    from autoshard.capture.init import record_build
    from autoshard.passes.contract import RewriteContext
    from autoshard.passes.flash_attention import flash_attention

    if recorded:
        model, inits = record_build(BufferMasked, window=window)
    else:
        with torch.device("meta"):
            model, inits = BufferMasked(window=window), None
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long, device="meta"),), inits=inits)
    graph = cap.graph_module.graph
    (fill,) = [n for n in graph.nodes if n.meta["op"] == "masked_fill"]
    (softmax,) = [n for n in graph.nodes if n.meta["op"] == "softmax"]
    assert fill.meta.get("causal") is (True if kind is None else None)
    assert getattr(softmax.meta.get("mask"), "kind", None) == kind
    gm = flash_attention(cap.graph_module, RewriteContext())
    fused = [n for n in gm.graph.nodes if n.target is runtime.fused_attention]
    assert len(fused) == (1 if kind is None else 0)
    assert [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith(".bias")]


# ---------------------------------------------------------------------------------------------
# Products by a transposed parameter


def _product_graph(transpose) -> fx.GraphModule:
    """``x @ w.T`` as torch.export gives Falcon's ``FalconLinear`` (``transpose``: how w is turned)."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("weight")
    g.output(g.call_function(aten.matmul.default, (x, g.call_function(*transpose(w)))))
    root = nn.Module()
    root.weight = nn.Parameter(torch.randn(6, 8))
    return fx.GraphModule(root, g)


@pytest.mark.parametrize(
    "transpose",
    [
        lambda w: (aten.numpy_T.default, (w,)),
        lambda w: (aten.t.default, (w,)),
        lambda w: (aten.permute.default, (w, [1, 0])),
    ],
    ids=["numpy_T", "t", "permute"],
)
def test_a_product_by_a_transposed_parameter_becomes_linear(transpose):
    before = _product_graph(transpose)
    x = torch.randn(2, 5, 8)
    expected = before(x)
    gm = canonicalize(before)
    g = fx.Graph()
    g.output(g.call_function(aten.linear.default, (g.placeholder("x"), g.get_attr("weight"))))
    assert listing(gm.graph) == listing(g)
    assert torch.allclose(gm(x), expected)


def test_a_product_by_an_activation_or_a_shared_transpose_stays():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.get_attr("weight")
    wt = g.call_function(aten.t.default, (w,))
    a = g.call_function(aten.matmul.default, (x, g.call_function(aten.t.default, (x,))))  # activations
    g.output((a, g.call_function(aten.matmul.default, (x, wt)), wt))  # w.T read twice
    root = nn.Module()
    root.weight = nn.Parameter(torch.randn(6, 8))
    before = listing(g)
    assert listing(canonicalize(fx.GraphModule(root, g)).graph) == before


# ---------------------------------------------------------------------------------------------
# MoE loop forms (passes.moe_forms): a loop over an nn.ModuleList of experts becomes grouped GEMMs


def _exported_moe(name: str, bias: bool = False) -> tuple[fx.GraphModule, torch.Tensor]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    if bias:  # one expert of different structure: the loop is not one expert subgraph E times
        model.layers[0].ffn.experts[1].up.bias = nn.Parameter(torch.randn(96))
    tokens = torch.randint(0, 128, (2, 8))
    return torch.export.export(model, (tokens,)).module(), tokens


def _moe_nodes(gm: fx.GraphModule) -> tuple[int, int, list[list[str]]]:
    """(grouped GEMMs, where nodes, the parameters each torch.stack reads)."""
    grouped = sum(n.target is moe.grouped_mm for n in gm.graph.nodes)
    wheres = sum(n.target is aten.where.default for n in gm.graph.nodes)
    stacks = [[a.target for a in n.args[0]] for n in gm.graph.nodes if n.target is aten.stack.default]
    return grouped, wheres, stacks


@pytest.mark.parametrize(
    "name,projections",
    [("naive_moe", ("up", "down")), ("reference_moe", ("w1", "w3", "w2"))],
    ids=["where-index_put", "one_hot-index_add_"],
)
def test_a_loop_over_expert_modules_becomes_grouped_gemms_of_the_same_values(name, projections):
    gm, tokens = _exported_moe(name)
    before = gm(tokens)
    assert _moe_nodes(gm)[:2] == (0, 8)  # 2 layers x 4 experts, each its where
    assert expert_loops(gm)
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(tokens), before, rtol=1e-6, atol=1e-6)
    grouped, wheres, stacks = _moe_nodes(gm)
    assert (grouped, wheres) == (2 * len(projections), 0)
    # each projection is the stack of the four experts' own parameters, by their own names
    ffn = "ffn" if name == "naive_moe" else "moe"
    layer0 = [s for s in stacks if s[0].startswith(f"layers.0.{ffn}")]
    assert sorted(layer0) == sorted([f"layers.0.{ffn}.experts.{e}.{p}.weight" for e in range(4)] for p in projections)


def test_experts_of_different_structure_stay_a_loop():
    gm, tokens = _exported_moe("naive_moe", bias=True)
    before = gm(tokens)
    assert expert_loops(gm)  # layer 1's experts are alike: grouped; layer 0's stay as written
    gm.recompile()
    torch.testing.assert_close(gm(tokens), before, rtol=1e-6, atol=1e-6)
    grouped, wheres, _ = _moe_nodes(gm)
    assert (grouped, wheres) == (2, 4)


def test_per_token_gathered_expert_weights_become_grouped_gemms_of_the_same_values():
    """transformers' ``batched_mm`` experts (``bmm(W[ids], h)`` per routed slot) become grouped
    GEMMs by the stacked parameters over the slots sorted by expert, sorted back where they leave."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    hf_moe = pytest.importorskip("hf_moe")
    torch.manual_seed(0)
    model = hf_moe.build("mixtral-batched")
    inputs = hf_moe.sample_inputs("mixtral-batched", 2, 8)
    gm, tracer, _ = trace(model, inputs)
    assert tracer == "export"
    before = gm(*inputs)
    assert sum(n.target is aten.bmm.default for n in gm.graph.nodes) == 4  # 2 layers x (gate_up, down)
    assert batched_experts(gm)
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(*inputs), before, rtol=1e-6, atol=1e-6)
    assert sum(n.target is aten.bmm.default for n in gm.graph.nodes) == 0
    grouped = [n for n in gm.graph.nodes if n.target is moe.grouped_mm]
    assert [n.args[1].args[0].target for n in grouped] == [
        f"model.model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    ]


def test_the_reference_loop_on_a_symbolic_trace_graph_becomes_grouped_gemms_of_the_same_values():
    """symbolic_trace's form of the same loop: nn.Linear module calls, torch.where on the one-hot
    slices, in-place index_add_ on one accumulator whose sum is read after the loop."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import reference_moe

    torch.manual_seed(0)
    model = reference_moe.build("tiny")
    inputs = reference_moe.sample_inputs("tiny", 2, 8)
    gm, tracer, _ = trace(model, inputs)
    assert tracer == "symbolic_trace"
    before = gm(*inputs)
    assert expert_loops(gm)
    gm.graph.lint()
    gm.recompile()
    torch.testing.assert_close(gm(*inputs), before, rtol=1e-6, atol=1e-6)
    grouped, wheres, stacks = _moe_nodes(gm)
    assert (grouped, wheres) == (6, 0)
    assert not any(n.op == "call_module" and ".experts." in n.target for n in gm.graph.nodes)
    assert stacks[0] == [f"model.layers.0.moe.experts.{e}.w1.weight" for e in range(4)]

"""Context-parallel pass: the model reads its tokens in the CP layout, positions become global,
causal attention becomes cp_attention, and the loss becomes this rank's share of the mean."""

import re
import sys
from pathlib import Path

import pytest
import torch

from autoshard import runtime
from autoshard.capture import capture, capture_file, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.passes.context_parallel import context_parallel, no_full_sequence_attention_left
from autoshard.passes.contract import Refusal, RewriteContext
from autoshard.passes.flash_attention import flash_attention

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _count(gm, fn):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is fn)


def test_llama_cp2_graph():
    import llama3

    cap = capture(llama3.build("tiny"), (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    gm = cap.graph_module
    ctx = RewriteContext(cp=2, attention="ring")
    gm = context_parallel(flash_attention(gm, ctx), ctx)
    assert _count(gm, runtime.cp_shard) == 2  # the model's tokens, and the loss's labels
    assert _count(gm, runtime.cp_positions) == 4  # rotary angles of q and k in each of 2 layers
    assert _count(gm, runtime.cp_attention) == 2 and _count(gm, runtime.fused_attention) == 0
    assert _count(gm, runtime.cp_cross_entropy) == 1
    # without a CP group every runtime call is the identity: the loss is the single-device loss
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = capture(cap.model, (torch.zeros(2, 16, dtype=torch.long),)).graph_module
    assert torch.allclose(gm(tokens), plain(tokens), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Before/Expected on a small hand-written model


class Tiny(torch.nn.Module):
    """Causal attention by ``is_causal``, or by a mask tensor: causal (``window=None``) or a
    sliding window of ``window`` positions, and within documents separated by token 0 where
    ``documents``."""

    def __init__(self, masked: bool = False, window: int | None = None, start: int | None = None, documents=False):
        super().__init__()
        self.start = start  # positions as arange(start, start + s) rather than arange(s)
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96, bias=False)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.masked, self.window, self.documents = masked, window, documents

    def forward(self, tokens):
        b, s = tokens.size(0), tokens.size(1)
        positions = torch.arange(s) if self.start is None else torch.arange(self.start, self.start + s)
        x = self.embed(tokens) + positions[:, None].float()
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
        mask = None
        if self.masked:
            ones = torch.ones(s, s, dtype=torch.bool)
            mask = ones.tril() & ~ones.tril(-self.window) if self.window else ones.tril()
        if self.documents:
            document = (tokens == 0).cumsum(-1)
            mask = mask & (document[:, None, :, None] == document[:, None, None, :])
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.masked)
        return self.head(out.transpose(1, 2).reshape(b, s, 32))


def _calls(gm):
    return [
        n.meta["op"] for n in gm.graph.nodes if n.op == "call_function" and n.target.__module__.startswith("autoshard")
    ]


def test_tokens_positions_attention_and_loss_become_the_cp_calls():
    cap = capture(Tiny(), (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(cp=2, attention="allgather-kv")
    gm = context_parallel(cap.graph_module, ctx)
    # Expected, in program order: this rank's tokens, their global positions, attention over the
    # CP group, the labels in the same layout, this rank's share of the mean loss
    assert _calls(gm) == ["cp_shard", "cp_positions", "cp_attention", "cp_shard", "cp_cross_entropy"]
    (attn,) = [n for n in gm.graph.nodes if n.target is runtime.cp_attention]
    assert attn.args[3] == "allgather-kv" and attn.meta["op_class"] == "attention"
    (loss,) = [n for n in gm.graph.nodes if n.target is runtime.cp_cross_entropy]
    assert loss.meta["op_class"] == "loss" and loss.args[2] == -100
    assert no_full_sequence_attention_left(gm, ctx) is None


def _ring(model):
    """``model`` captured at 8 tokens, analysed, and rewritten for ring attention over CP2."""
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    return context_parallel(cap.graph_module, RewriteContext(cp=2, attention="ring"))


def _computes_the_models_loss(gm, model) -> bool:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return torch.allclose(gm(tokens), causal_lm_loss(model(tokens), tokens), atol=1e-6)


def test_positions_written_as_arange_from_0_are_sharded_and_from_1_refused():
    model = Tiny(start=0)
    gm = _ring(model)
    assert _calls(gm) == ["cp_shard", "cp_positions", "cp_attention", "cp_shard", "cp_cross_entropy"]
    assert _computes_the_models_loss(gm, model)
    with pytest.raises(Refusal, match="arange over the sequence with a start other than 0"):
        _ring(Tiny(start=1))


def test_a_causal_mask_tensor_is_sharded_as_causal_attention():
    """Capture made the tril mask ``is_causal``: the pass shards it, and the rewritten graph still
    computes the masked model's loss."""
    model = Tiny(masked=True)
    gm = _ring(model)
    assert _calls(gm) == ["cp_shard", "cp_positions", "cp_attention", "cp_shard", "cp_cross_entropy"]
    assert _computes_the_models_loss(gm, model)


def test_sliding_window_attention_becomes_cp_attention_with_its_window():
    """The band mask goes (its nodes with it) and the window travels with the call; on one
    process the call computes the masked model's loss."""
    model = Tiny(masked=True, window=4)
    gm = _ring(model)
    assert _calls(gm) == ["cp_shard", "cp_positions", "cp_attention", "cp_shard", "cp_cross_entropy"]
    (attn,) = [n for n in gm.graph.nodes if n.target is runtime.cp_attention]
    assert attn.args[5] == 4 and "window 4" in attn.meta["note"]
    assert not [n for n in gm.graph.nodes if n.meta.get("op") in ("ones", "tril", "and_", "bitwise_and")]
    assert _computes_the_models_loss(gm, model)


class WrittenOut(Tiny):
    """Tiny's sliding window written out: ``softmax(masked_fill(q @ k^T, outside the band)) @ v``."""

    def forward(self, tokens):
        b, s = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(self.embed(tokens)).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
        ones = torch.ones(s, s, dtype=torch.bool)
        scores = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(ones.triu(1) | ones.tril(-self.window), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.head(out.transpose(1, 2).reshape(b, s, 32))


def test_a_written_out_sliding_window_is_refused_for_cp_naming_the_window():
    cap = capture(WrittenOut(window=4), (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(cp=2, attention="ring")
    match = (
        r"written-out sliding-window attention \(window 4\), which the flash-attention pass does not fuse "
        r"\(call scaled_dot_product_attention with the mask to shard it\); plan with --force cp=1"
    )
    with pytest.raises(Refusal, match=match):
        context_parallel(flash_attention(cap.graph_module, ctx), ctx)


def test_document_masking_is_refused_for_cp_naming_the_mask_and_the_fix():
    cap = capture(Tiny(masked=True, documents=True), (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    match = (
        r"document masking \(a mask comparing the input 'tokens' with itself\) is not sharded by context "
        r"parallelism, only causal and sliding-window attention are \(train on packed sequences without "
        r"document masking to shard it\); plan with --force cp=1"
    )
    with pytest.raises(Refusal, match=match) as e:
        context_parallel(cap.graph_module, RewriteContext(cp=2, attention="ring"))
    # the model, not the degree, is the obstacle: the planner leaves out every cp above 1
    assert (e.value.axis, e.value.exclusion()) == ("cp", "*")
    assert "test_context_parallel.py:" in str(e.value)


def test_alibi_is_refused_for_cp_naming_alibi_and_the_fix():
    """Bloom adds ALiBi to its scores (``alibi.baddbmm(q, k)``): capture on meta (the emitted
    program's casts in the bias's computation included) sees the bias from positions, and the
    refusal names it, not the view on the way to the softmax."""
    pytest.importorskip("transformers")
    cap = capture_file(str(EXAMPLES.parent / "tests" / "models" / "hf_zoo.py"), "bloom", 32)
    (first, *_) = [n for n in cap.graph_module.graph.nodes if n.meta.get("op") == "softmax"]
    assert first.meta["mask"].kind == "positional_bias"
    analyze(cap)
    ctx = RewriteContext(cp=2, attention="ring")
    match = (
        r"ALiBi \(an additive bias of a slope per head times the key position\) is not sharded by context "
        r"parallelism, only causal and sliding-window attention are \(use rotary position embeddings instead "
        r"to shard it\); plan with --force cp=1"
    )
    with pytest.raises(Refusal, match=match):
        context_parallel(flash_attention(cap.graph_module, ctx), ctx)


def test_nanogpts_attention_masked_by_its_buffer_runs_as_ring_attention():
    """nanoGPT masks its scores with ``masked_fill`` by a ``tril`` buffer built on meta: its
    recorded initialisation shows it causal, the written-out attention is fused, and CP shards it."""
    cap = capture_file(str(EXAMPLES.parent / "tests" / "models" / "nanogpt.py"), "tiny", 32)
    analyze(cap)
    ctx = RewriteContext(cp=2, attention="ring")
    gm = context_parallel(flash_attention(cap.graph_module, ctx), ctx)
    assert _count(gm, runtime.cp_attention) == 2 and _count(gm, runtime.fused_attention) == 0


def test_a_mask_read_from_a_buffer_is_refused_for_cp_naming_the_buffer_and_the_fix():
    """A ``tril`` buffer on meta whose initialisation was not recorded (a model built by hand, not
    by ``record_build``) has no values: the refusal names the buffer and what to write instead,
    not the softmax alone."""
    sys.path.insert(0, str(EXAMPLES.parent / "tests" / "models"))
    import nanogpt

    with torch.device("meta"):
        model = nanogpt.build("tiny")
    cap = capture(model, (torch.zeros(2, 32, dtype=torch.long, device="meta"),), source=nanogpt.__file__)
    analyze(cap)
    ctx = RewriteContext(cp=2, attention="ring")
    match = (
        r"the softmax at nanogpt\.py:\d+ \(transformer\.h\.0\.attn\): a mask read from the buffer "
        r"'model\.transformer\.h\.0\.attn\.bias' \(no values on the meta device: not known causal\) is not "
        r"sharded by context parallelism, .* \(build the mask in forward from positions, or call "
        r"scaled_dot_product_attention\(is_causal=True\), to shard it\); plan with --force cp=1"
    )
    with pytest.raises(Refusal, match=match):
        context_parallel(flash_attention(cap.graph_module, ctx), ctx)


def test_a_refusal_in_a_transformers_model_names_the_library_line_in_words():
    """Gemma 2 soft-caps its scores: the refusal names the op and the line of transformers'
    modeling file that wrote it (torch.export keeps ``forward`` frames: the attention call), and
    the module, not an fx node dump nor the training wrapper's line."""
    transformers = pytest.importorskip("transformers")
    cap = capture_file(str(EXAMPLES.parent / "tests" / "models" / "hf_zoo.py"), "gemma2", 16)
    analyze(cap)
    with pytest.raises(Refusal) as e:
        context_parallel(cap.graph_module, RewriteContext(cp=2, attention="ring"))
    message = str(e.value)
    where = re.match(r"context parallelism cannot handle the softmax at modeling_gemma2\.py:(\d+) (\S+): ", message)
    assert where and where.group(2) == "(model.layers.0.self_attn)", message
    modeling = Path(transformers.models.gemma2.modeling_gemma2.__file__).read_text().splitlines()
    assert "attention_interface(" in modeling[int(where.group(1)) - 1]
    assert "tanh" in message and "%" not in message and "call_function[" not in message

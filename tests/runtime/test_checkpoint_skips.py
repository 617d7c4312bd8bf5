"""A selective checkpoint's recomputation skips what nothing it remakes needs: torch's replays the
layer's forward up to the last op whose output autograd saved and runs every op it did not cache
on the way. Here the output projection ``h @ wo`` feeds only the residual sum, which the cache
keeps (a norm reads it): torch's recomputation would run the projection again (and, under TP, its
reduce-scatter); this one does not. Measured at full scale (``benchmarks/at_scale.py``): LLaMA-3
405B under Meta's TP8 x PP16 ran 10% more tensor-parallel bytes than planned, GPT-3 175B 11% more
FLOPs (its second MLP product before the dropout)."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime import phase

D, TOKENS = 64, 32


def _weights():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(D, D, generator=g) / D**0.5).requires_grad_() for _ in range(3)]


def _layer(wi, wo, wm, dropout: bool):
    def fn(x):
        h = F.silu(x @ wi.t())  # recomputed: silu keeps its input, the matmul's cached output
        o = h @ wo.t()  # nothing keeps it: its sum is cached
        if dropout:
            o = F.dropout(o, 0.1)  # recomputed (the mask is random), its input's values unneeded
        r = x + o  # the residual sum the norm keeps
        return r + F.layer_norm(r, (D,)) @ wm.t()

    return fn


def _run(wrap, dropout=False):
    torch.manual_seed(3)
    w = _weights()
    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    module = wrap(_layer(*w, dropout))
    y = module(x)
    with FlopCounterMode(display=False) as flops:
        (y**2).mean().backward()
    return x.grad, [t.grad for t in w], flops.get_total_flops()


def test_the_recomputation_skips_the_projection_nothing_needs():
    plain = _run(lambda fn: fn)
    kept = _run(lambda fn: ckpt.Checkpoint(fn, ["activation", "norm_output"]))
    assert torch.allclose(kept[0], plain[0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kept[1], plain[1]))
    # the backward's FLOPs and the norm's rerun; the projection (2 * TOKENS * D * D) is not run again
    assert kept[2] == plain[2]


def test_a_dropout_remade_for_its_mask_does_not_need_its_input():
    plain = _run(lambda fn: fn, dropout=True)
    kept = _run(lambda fn: ckpt.Checkpoint(fn, ["activation", "norm_output", "dropout_mask"]), dropout=True)
    assert torch.allclose(kept[0], plain[0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kept[1], plain[1]))
    assert kept[2] == plain[2]


def test_what_a_skipped_op_would_have_made_is_remade_where_needed():
    # the projection's output read by a kept ``sigmoid``'s... recomputed silu: needed, so it runs
    def fn(x, wi, wo):
        o = x @ wo.t()
        return F.silu(o) + x @ wi.t()

    w = _weights()
    x = torch.randn(TOKENS, D).requires_grad_()
    ref = fn(x, w[0], w[1])
    ref.sum().backward()
    expect = [x.grad.clone()] + [t.grad.clone() for t in w[:2]]
    x.grad = None
    for t in w:
        t.grad = None
    module = ckpt.Checkpoint(lambda x: fn(x, w[0], w[1]), ["activation"])
    module(x).sum().backward()
    got = [x.grad] + [t.grad for t in w[:2]]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expect))


def _recomputed_layer(w, bookkeeping: list):
    def fn(x):
        h = x @ w[0].t()
        if torch._C._current_graph_task_id() == -1:  # the forward only: a count, as an MoE's load
            with phase.unrecorded():
                bookkeeping.append((h.detach() > 0).sum() + 0)
        o = F.silu(h) @ w[1].t()
        r = x + o
        return F.layer_norm(r, (D,)) @ w[2].t()

    return fn


def test_a_region_with_skipped_calls_recomputes_once_per_backward_call():
    # a split backward (input pass, then weight pass) recomputes a layer that caches nothing once
    # per call: the skipped calls' entries stay for the second, where torch marks an entry used
    def fn(x, w):
        h = x @ w[0].t()
        side = h @ w[1].t()  # read by the output's sum only: skipped in each recomputation
        return F.silu(h) @ w[2].t() + side

    w = _weights()
    x = torch.randn(TOKENS, D).requires_grad_()
    gx, *gw = torch.autograd.grad((fn(x, w) ** 2).mean(), [x, *w])
    everything = ["activation", "attention", "experts", "linear_output", "norm_input", "norm_output"]
    module = ckpt.Checkpoint(lambda x: fn(x, w), everything)  # keeps dropout masks: a selective region
    loss = (module(x) ** 2).mean()
    with FlopCounterMode(display=False) as flops:
        (got_x,) = torch.autograd.grad(loss, [x], retain_graph=True)
        got_w = torch.autograd.grad(loss, w)
    assert torch.allclose(got_x, gx, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got_w, gw))
    product = 2 * TOKENS * D * D
    # two recomputations of two products each (not three), and the backward's six
    assert flops.get_total_flops() == (2 * 2 + 6) * product


def test_what_only_the_forward_runs_does_not_shift_the_cache():
    # the forward's bookkeeping ``add`` runs out of the cache's sight: the kept residual sum is
    # the recomputation's second add, as it was the forward's
    w = _weights()
    x = torch.randn(TOKENS, D).requires_grad_()
    seen: list = []
    ref = _recomputed_layer(w, seen)(x)
    ref.sum().backward()
    expect = [x.grad.clone()] + [t.grad.clone() for t in w]
    x.grad = None
    for t in w:
        t.grad = None
    module = ckpt.Checkpoint(_recomputed_layer(w, seen), ["activation", "norm_output"])
    module(x).sum().backward()
    assert len(seen) == 2  # counted in each forward, not in the recomputation
    got = [x.grad] + [t.grad for t in w]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expect))


def test_counts_read_on_the_host_are_remade():
    # ``tolist`` reads a tensor out of the policy's sight: an integer output (counts, indices) is
    # never skipped, or the recomputation would size its tensors from uninitialised memory
    def fn(x, w):
        h = x @ w[0].t()
        counts = (h > 0).sum(0)
        order = torch.tensor(counts.tolist()).clamp(0, D - 1)  # the host reads the counts
        return F.silu(h).index_select(1, order) @ w[1].t()

    w = _weights()
    x = torch.randn(TOKENS, D).requires_grad_()
    ref = fn(x, w)
    expect = torch.autograd.grad(ref.sum(), [x, *w[:2]])
    module = ckpt.Checkpoint(lambda x: fn(x, w), ["activation"])
    got = torch.autograd.grad(module(x).sum(), [x, *w[:2]])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, expect))


def test_an_exchange_nothing_remade_needs_is_not_sent_again():
    """An EP all-to-all writes into a buffer made before it (``empty``), and the received tokens
    are reshaped by ``_unsafe_view``, no view to autograd: the recomputation sent the tokens again
    though nothing it remade read them (DeepSeek-V3-shaped model with the experts kept)."""
    sent = []
    w = _weights()

    def fn(x):
        h = x @ w[0].t()  # recomputed: a linear output
        out = torch.empty_like(h)
        ckpt.collective(lambda: (sent.append(1), out.copy_(h)), out)  # the exchange
        r = torch.ops.aten._unsafe_view(out, (TOKENS, D)) + x  # a sum a norm reads: kept
        return F.layer_norm(r, (D,)) @ w[2].t()

    x = torch.randn(TOKENS, D).requires_grad_()
    y = ckpt.Checkpoint(fn, ["activation", "linear_output", "norm_output"])(x)
    (y**2).mean().backward()
    assert len(sent) == 1  # the forward's; twice before
    assert x.grad is not None and w[0].grad is not None


def test_an_exchange_the_recomputation_needs_sends_what_it_sent():
    """An exchange replayed (its buffer read by an op the recomputation remakes) needs what it
    sends: here a matmul output the cache lets go (no op keeping its input reads it). Before, the
    sweep never reached the exchange's input from its buffer, skipped the matmul and sent its
    uninitialised output (DeepSeek-V3's combine sent the experts' rows so, measured as 7% fewer
    FLOPs than planned at full scale, and its gradients were wrong)."""
    with _one_rank():
        w = _weights()

        class Exchange(torch.autograd.Function):  # as the EP all-to-alls: into a buffer made before
            @staticmethod
            def forward(ctx, rows):
                out = torch.empty_like(rows)
                ckpt.collective(lambda: dist.all_to_all_single(out, rows.contiguous()), out)
                return out

            @staticmethod
            def backward(ctx, grad):
                return grad  # one rank: the exchange is the identity

        def fn(x, exchange: bool):
            h = x @ w[0].t()  # kept by the policy (a linear output), let go: only the exchange reads it
            out = Exchange.apply(h) if exchange else h
            return F.silu(out) @ w[1].t()  # silu, recomputed, keeps what the exchange wrote

        x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(5)).requires_grad_()
        expect = torch.autograd.grad((fn(x, False) ** 2).mean(), [x, w[0], w[1]])
        module = ckpt.Checkpoint(lambda x: fn(x, True), ["activation"])
        got = torch.autograd.grad((module(x) ** 2).mean(), [x, w[0], w[1]])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expect))


def test_a_matmul_output_a_context_parallel_gather_reads_stays_cached():
    """The all-gather CP attention reads the local K/V through a gather and keeps what it
    gathered: a kept matmul output it reads (MLA's value projection) stays cached, as the cost
    model counts it, and the recomputation gathers it again without running the matmul again
    (before, the cache let it go: DeepSeek-V3-shaped model at CP2 used 12% less memory than
    planned and ran the projection twice)."""
    from autoshard.runtime.ring_attention import _GatherSeq

    with _one_rank() as group:
        w = _weights()

        def fn(x, gather: bool):
            v = (x @ w[0].t()).view(1, 1, TOKENS, D)  # a linear output, kept
            v = _GatherSeq.apply(v, group) if gather else v
            return (F.silu(v) * v).view(TOKENS, D) @ w[1].t()  # silu recomputed, the product keeps v

        x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(5)).requires_grad_()

        def run(module):
            return _backward(module, [x], [x, w[0], w[1]])

        plain = run(lambda x: fn(x, False))
        module = ckpt.Checkpoint(lambda x: fn(x, True), ["activation"])
        kept = run(module)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kept[0], plain[0]))
        assert kept[1] == plain[1]  # the backward's GEMMs only: the projection is not run again


@pytest.mark.parametrize("scaled", [True, False], ids=["read-by-a-product", "read-by-a-sum"])
def test_an_expert_exchange_is_kept_whole_where_the_plan_keeps_the_experts(scaled):
    """An expert exchange under a checkpoint keeping the experts runs once: the recomputation
    takes its output as the forward made it (kept where a remade op or autograd reads it: the
    routing weights' product keeps it; a sum keeps nothing, and then nothing is held). Before,
    Mixtral 8x22B's recomputations sent its tokens to the experts and back again, twice the
    planned expert-parallel bytes, and ran the experts' second GEMM again for the combine."""
    sent = []
    w = _weights()
    order = torch.randperm(TOKENS, generator=torch.Generator().manual_seed(3))

    def send(rows):  # as moe.combine: reorder, then the all-to-all (one rank: the identity)
        sent.append(1)
        return rows.index_select(0, order)

    def fn(x, p, kept: bool):
        h = x @ w[0].t()  # the experts' product (the policy would keep it; only the exchange reads it)
        back = ckpt.kept_whole("experts", send, h) if kept else send(h)
        out = back * p if scaled else back + x  # the routing weights' product keeps ``back``
        return F.silu(out) @ w[1].t()  # recomputed: an activation

    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(5)).requires_grad_()
    p = torch.rand(TOKENS, 1, generator=torch.Generator().manual_seed(6)).requires_grad_()

    def run(module):
        return _backward(module, [x, p], [x, w[0], w[1], *([p] if scaled else [])])

    plain = run(lambda x, p: fn(x, p, False))
    sent.clear()
    kept = run(ckpt.Checkpoint(lambda x, p: fn(x, p, True), ["activation"]))
    assert len(sent) == 1  # the forward's
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kept[0], plain[0]))
    assert kept[1] == plain[1]  # the experts' product is not run again
    sent.clear()
    again = run(ckpt.Checkpoint(lambda x, p: fn(x, p, True), ["activation", "experts"]))
    assert len(sent) == 2  # recomputing the experts: the exchange runs again in the recomputation
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(again[0], plain[0]))


@pytest.mark.parametrize("recompute", [["activation"], ["activation", "experts"]])
def test_the_experts_gemms_inputs_are_kept_where_the_plan_keeps_the_experts(recompute):
    """The experts' second GEMM reads the activations' product, which the cost model counts as
    an ``experts`` tensor: kept with the experts, the recomputation runs neither the product nor
    the activation function (before, it ran both and held neither: Mixtral 8x22B's ranks held
    13% fewer activation bytes than planned, 0.83 of the planned peak)."""
    from autoshard.atscale import FlopCounter, flop_formulas

    from conftest import cache_storages

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(TOKENS, D, generator=gen).requires_grad_()
    w1 = (torch.randn(2, D, 4 * D, generator=gen) / D**0.5).requires_grad_()
    w2 = (torch.randn(2, 2 * D, D, generator=gen) / D**0.5).requires_grad_()
    offs = torch.tensor([TOKENS // 4, TOKENS], dtype=torch.int32)

    def fn(x):
        gate, up = torch._grouped_mm(x, w1, offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2, offs)

    expect = torch.autograd.grad((fn(x) ** 2).mean(), [x, w1, w2])
    module = ckpt.Checkpoint(fn, recompute)
    caches = cache_storages(module)
    y = module(x)
    with FlopCounter(display=False, custom_mapping=flop_formulas()) as flops:
        got = torch.autograd.grad((y**2).mean(), [x, w1, w2])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, expect))
    recompute_marker = torch.utils.checkpoint._RECOMPUTE
    products = [e for e in caches[0][torch.ops.aten.mul.Tensor].values() if e is not recompute_marker]
    kept = "experts" not in recompute
    assert len(products) == kept  # cached (and taken by the backward)
    assert len(products) == kept
    assert (
        flops.get_total_flops() == (3 if kept else 4) * 2 * TOKENS * D * 4 * D
    )  # the first GEMM's forward too when recomputing the experts


@pytest.mark.parametrize("recompute", [["norm_output"], ["activation"]])
def test_a_kept_unit_remakes_only_the_inputs_the_plan_recomputes(recompute):
    """Where the plan keeps attention, a ``unit`` (ring attention) keeps what its backward reads
    and the recomputation takes its output as made. Its inputs are kept with it where the plan
    keeps their kind, and then nothing remakes them: before, the recomputation remade them
    anyway, the query and key projections of LLaMA-3 405B's layers (read only by the rotary
    embedding, so the cache had let them go) in both passes of the split backward, 1.060 of the
    planned FLOPs on TP4 x PP32 x CP4 zero-bubble. Where the plan recomputes their kind (the
    rotary embedding's outputs are activations), the unit saves them through the checkpoint and
    the recomputation remakes them, as the plan counts (Mixtral 8x22B: 0.96 of the planned
    FLOPs while they were kept)."""
    w = _weights()

    class Scores(torch.autograd.Function):  # keeps its input for its own backward, as attention
        @staticmethod
        def forward(ctx, q):
            ctx.save_for_backward(q)
            return q * q

        @staticmethod
        def backward(ctx, grad):
            (q,) = ctx.saved_tensors
            return 2 * q * grad

    def fn(x, unit: bool):
        q = (x @ w[0].t()) * 0.5  # a linear output only a product reads: let go by the cache
        a = ckpt.unit(Scores.apply, q) if unit else Scores.apply(q)
        return F.layer_norm(a, (D,)) @ w[1].t()

    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(5)).requires_grad_()

    def run(module):
        return _backward(module, [x], [x, w[0], w[1]])

    plain = run(lambda x: fn(x, False))
    kept = run(ckpt.Checkpoint(lambda x: fn(x, True), recompute))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kept[0], plain[0]))
    again = 0 if recompute == ["norm_output"] else 2 * TOKENS * D * D  # the projection's forward
    assert kept[1] == plain[1] + again


@pytest.mark.parametrize("recompute", [["norm_output"], ["activation"]])
def test_what_a_kept_activation_gemm_reads_is_kept(recompute):
    """A GEMM's input made by an op of no kind (the SwiGLU product, the copy of the attention's
    output before its projection) is an ``activation`` to the plan: kept where the plan keeps
    activations, so the recomputation runs neither it nor the activation function. Before,
    the policy cached neither and remade both: LLaMA-3 405B's ranks held 0.76-0.80 of the
    planned activation bytes (0.86-0.89 of the planned peak)."""
    from conftest import cache_storages

    g = torch.Generator().manual_seed(11)
    w1, w3, w2 = (
        (torch.randn(*shape, generator=g) / D**0.5).requires_grad_() for shape in ((4 * D, D),) * 2 + ((D, 4 * D),)
    )

    def fn(x):
        h = F.layer_norm(x, (D,))
        return (F.silu(h @ w1.t()) * (h @ w3.t())) @ w2.t()

    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(5)).requires_grad_()
    expect = torch.autograd.grad((fn(x) ** 2).mean(), [x, w1, w2, w3])
    module = ckpt.Checkpoint(fn, recompute)
    caches = cache_storages(module)
    y = module(x)
    with FlopCounterMode(display=False) as flops:
        got = torch.autograd.grad((y**2).mean(), [x, w1, w2, w3])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, expect))
    products = [e for e in caches[0][torch.ops.aten.mul.Tensor].values() if e is not torch.utils.checkpoint._RECOMPUTE]
    kept = "activation" not in recompute
    assert len(products) == kept
    # the three products' gradients (two GEMMs each) and nothing more: the GEMMs' outputs stay
    # cached either way (the activation function reads its input, the product the second's)
    assert flops.get_total_flops() == 3 * 2 * 2 * TOKENS * D * 4 * D


def _backward(module, inputs, params):
    """The gradients of ``params`` through ``module(*inputs)`` (its forward run first, outside the
    count), and the FLOPs of that backward."""
    y = module(*inputs)
    with FlopCounterMode(display=False) as flops:
        grads = torch.autograd.grad((y**2).mean(), params)
    return grads, flops.get_total_flops()


@contextlib.contextmanager
def _one_rank():
    """A one-rank gloo group (the default one): collectives that run, moving nothing."""

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if own:
            dist.destroy_process_group()

"""A split backward's weight pass (``runtime.program.weight_pass``): the weights' gradients are
those of a whole backward, computed with the FLOPs of torch's own weight pass, and a checkpointed
layer is recomputed once in it, where torch's per-parameter-group calls recompute it once per
group and keep each copy while the chunk's graph lives (measured at DeepSeek-V3 671B under
DualPipeV: 91 GB at the peak of a rank the plan gave 3.5 GB besides activations)."""

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from autoshard.atscale import FlopCounter
from autoshard.runtime.checkpoint import KINDS, Checkpoint
from autoshard.runtime.program import weight_pass

D = 32


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up, self.gate, self.down = nn.Linear(D, 4 * D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _model():
    torch.manual_seed(0)
    return nn.ModuleList([Layer() for _ in range(3)])


def _forward(layers, x, recompute):
    for layer in layers:
        if recompute:
            ckpt = Checkpoint(layer, recompute)
            ckpt.split_backward = True  # as the program sets it under a split-backward schedule
            x = ckpt(x)
        else:
            x = layer(x)
    return x


# none, full and selective recomputation: the selective checkpoint's cache serves the input
# pass's recomputation and the weight pass's (torch's allows one backward per region)
@pytest.mark.parametrize("recompute", [None, sorted(KINDS), ["activation", "norm_output"]])
def test_one_call_gives_the_whole_backwards_gradients_recomputing_each_layer_once(recompute):
    x0 = torch.randn(16, D, generator=torch.Generator().manual_seed(1))
    plain = _model()
    out = _forward(plain, x0.clone().requires_grad_(), None)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = [p.grad.clone() for p in plain.parameters()]

    grads, flops = {}, {}
    for name, second in (("ours", weight_pass), ("torch's", stage_backward_weight)):
        layers = _model()
        x = x0.clone().requires_grad_()
        # counting throughout (a selective recomputation meets the ops its forward made), without
        # the module tracker, whose hooks break the input pass's ``autograd.grad``
        with FlopCounter(display=False) as counter:
            out = _forward(layers, x, recompute)
            _, groups = stage_backward_input([out], [grad], [x], layers.parameters())
            before = [layer.calls for layer in layers]
            done = counter.get_total_flops()
            second(layers.parameters(), groups)
        flops[name] = counter.get_total_flops() - done
        grads[name] = [p.grad for p in layers.parameters()]
        runs = [layer.calls - b for layer, b in zip(layers, before)]
        if name == "ours":
            assert runs == ([1] * 3 if recompute else [0] * 3)  # one recomputation per layer, or none
        elif recompute:
            assert max(runs) > 1  # torch's: once per parameter group
    assert flops["ours"] <= flops["torch's"]  # nothing of the input pass runs again
    if not recompute:
        assert flops["ours"] == flops["torch's"]
    for got in grads.values():
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected))


def test_fp8_products_compute_each_gradient_in_its_own_pass():
    """An FP8 product's backward (a custom autograd Function) computes the input's gradient in
    the input pass and the weight's in the weight pass, not both in each: its
    ``needs_input_grad`` says only what required a gradient at forward time."""
    from autoshard.runtime import fp8

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(256, 128))
    x = torch.randn(64, 128, requires_grad=True)
    gy = torch.randn(64, 256)

    def flops(fn):
        with FlopCounter(display=False) as counter:
            out = fn()
        return counter.get_total_flops(), out

    y = fp8.fp8_linear(x, w).clone()  # a stage output is no view
    f_input, (grads, groups) = flops(lambda: stage_backward_input([y], [gy], [x], [w]))
    f_weight, _ = flops(lambda: stage_backward_weight([w], groups))
    one_gemm = 2 * 64 * 256 * 128
    assert f_input == one_gemm and f_weight == one_gemm
    whole_x, whole_w = torch.autograd.grad(fp8.fp8_linear(x, w), [x, w], gy)
    assert torch.equal(grads[0], whole_x) and torch.equal(w.grad, whole_w)


def test_the_input_pass_leaves_nothing_of_its_recomputation_to_the_weight_pass():
    """Under a split backward the selective cache keeps its entries for the weight pass's
    recomputation; torch hands a cached tensor itself to a recomputation, where autograd gives it
    that recomputation's history, so a kept entry kept the input pass's whole recomputed graph
    (every tensor it saved) until the weight pass: DeepSeek-V3-shaped model, TP1 x PP2 x EP8
    DualPipeV, selective recomputation, 7.73 GB measured on its busiest rank against 5.95
    planned, 6.36 since."""
    from conftest import cache_storages

    layers = _model()
    x = torch.randn(16, D, requires_grad=True)
    caches, h = [], x
    for layer in layers:
        ckpt = Checkpoint(layer, ["activation", "norm_output"])
        ckpt.split_backward = True
        caches.append(cache_storages(ckpt))
        h = ckpt(h)
    _, groups = stage_backward_input([h], [torch.ones_like(h)], [x], layers.parameters())
    cached = [
        w.val
        for made in caches
        for cache in made
        for calls in cache.values()
        for entry in calls.values()
        for w in torch.utils._pytree.tree_leaves(entry)
        if isinstance(getattr(w, "val", None), torch.Tensor)
    ]
    assert cached and not any(t.grad_fn is not None or t.requires_grad for t in cached)
    weight_pass(layers.parameters(), groups)  # and the weight pass still finds them
    assert all(p.grad is not None for p in layers.parameters())


class PassingOn(nn.Module):
    """A pipeline chunk that hands one input on unchanged (as a chunk hands on a table made
    once, in the first chunk) after a checkpointed layer that multiplies by it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = Layer()
        self.ckpt = Checkpoint(lambda x, t: self.layer(x * t), ["activation", "norm_output"])
        self.ckpt.split_backward = True

    def forward(self, x, table):
        return self.ckpt(x, table), table


@pytest.mark.parametrize("own", [True, False], ids=["handed-on-as-its-own", "torch's"])
def test_an_input_handed_on_keeps_its_gradient_for_the_weight_pass(own):
    """torch's input pass detaches the chunk's outputs in place: an input handed on unchanged is
    the chunk's input itself, which the weight pass's recomputation then reads without its
    gradient, saving fewer tensors than the forward (``CheckpointError`` at Mixtral 8x22B
    under zero-bubble). Handed on as a tensor of its own, it keeps it."""
    from autoshard.runtime.program import _hand_on_copies

    gen = torch.Generator().manual_seed(1)
    x0, t0 = torch.randn(16, D, generator=gen), torch.rand(16, D, generator=gen)
    plain = PassingOn()
    out, _ = plain(x0.clone().requires_grad_(), t0.clone().requires_grad_())
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = [p.grad.clone() for p in plain.parameters()]

    chunk = PassingOn()
    if own:
        _hand_on_copies(chunk)
    x, t = x0.clone().requires_grad_(), t0.clone().requires_grad_()
    out, t_out = chunk(x, t)
    assert (t_out is not t) == own
    _, groups = stage_backward_input([out, t_out], [grad, torch.zeros_like(t)], [x, t], chunk.parameters())
    if not own:
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            weight_pass(chunk.parameters(), groups)
        return
    assert t.requires_grad
    weight_pass(chunk.parameters(), groups)
    assert all(torch.allclose(p.grad, e, atol=1e-6) for p, e in zip(chunk.parameters(), expected))

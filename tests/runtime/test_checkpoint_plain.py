"""A layer whose plan recomputes every kind of tensor it has keeps nothing under the selective
checkpoint's policy (the kinds the plan keeps, such as the experts' outputs, do not occur in it):
after its first forward it runs under plain checkpointing, the same recomputation without the
policy's host time per op (on a CPU about 100 us per op). A layer that keeps something stays
selective. Gradients are those of the layer without checkpointing, before and after the switch."""

import torch
import torch.nn.functional as F

from autoshard.runtime.checkpoint import Checkpoint

D, TOKENS = 32, 16
ALL = ["activation", "attention", "linear_output", "norm_input", "norm_output"]


def _layer(wi, wo):
    def fn(x):
        h = F.silu(F.layer_norm(x, (D,)) @ wi.t())
        return x + h @ wo.t()

    return fn


def _grads(fn, x, wi, wo):
    for t in (x, wi, wo):
        t.grad = None
    fn(x).square().sum().backward()
    return [t.grad.clone() for t in (x, wi, wo)]


def _tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, D, generator=g, requires_grad=True)
    wi, wo = ((torch.randn(D, D, generator=g) / D**0.5).requires_grad_() for _ in range(2))
    return x, wi, wo


def test_a_layer_keeping_nothing_runs_plain_after_its_first_forward():
    x, wi, wo = _tensors()
    expected = _grads(_layer(wi, wo), x, wi, wo)
    wrapped = Checkpoint(_layer(wi, wo), recompute=ALL)
    assert wrapped._keeps and not wrapped._plain  # the plan's unused kinds (experts) are "kept"
    for step in range(3):
        got = _grads(wrapped, x, wi, wo)
        assert wrapped._plain, step
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_layer_keeping_its_linears_stays_selective():
    x, wi, wo = _tensors()
    expected = _grads(_layer(wi, wo), x, wi, wo)
    wrapped = Checkpoint(_layer(wi, wo), recompute=["activation"])
    for _ in range(2):
        got = _grads(wrapped, x, wi, wo)
        assert not wrapped._plain
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

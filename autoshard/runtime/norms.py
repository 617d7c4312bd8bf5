"""RMSNorm and LayerNorm as one op each, computing in fp32 and keeping for backward only their input
as it came (the residual stream's bf16, which the layer holds anyway) and the per-token statistics.

``torch.nn.functional.rms_norm`` and ``layer_norm`` under autocast first cast a bf16 input to fp32
(both are on autocast's fp32 list), and their CPU forms, written out, keep the fp32 cast and the
fp32 normalised values besides: three times the bytes of the input per norm. Megatron's fused norms
keep the input and the statistics, which is what autoshard's cost model counts (the norm's input
and, where the next product keeps it, its output). The ``fused_norm`` pass puts these in place of
the model's norms (``rt.rms_norm(x, shape, weight, eps)``, torch's signature); as ops they are also
what the recomputation policy names (``runtime.checkpoint``: the ``norm_output`` kind). The output
is in the input's dtype.
"""

from __future__ import annotations

import torch


def _flat(x: torch.Tensor, dims: int) -> torch.Tensor:
    """``x`` with its last ``dims`` dimensions (the normalised ones) as one, in fp32."""
    return x.reshape(*x.shape[: x.dim() - dims], -1).float()


@torch.library.custom_op("autoshard::rms_norm", mutates_args=())
def _rms(x: torch.Tensor, dims: int, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = _flat(x, dims)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (xf * rstd).view(x.shape)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd


@_rms.register_fake
def _(x, dims, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[: x.dim() - dims], 1), dtype=torch.float32)


@torch.library.custom_op("autoshard::rms_norm_backward", mutates_args=())
def _rms_backward(
    grad: torch.Tensor, x: torch.Tensor, dims: int, weight: torch.Tensor | None, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xhat = _flat(x, dims) * rstd
    g = _flat(grad, dims)
    gw = torch.zeros(1, device=x.device) if weight is None else (g * xhat).reshape(-1, xhat.size(-1)).sum(0)
    if weight is not None:
        g = g * weight.float().reshape(-1)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.view(x.shape).to(x.dtype), gw


@_rms_backward.register_fake
def _(grad, x, dims, weight, rstd):
    return torch.empty_like(x), (x.new_empty(1, dtype=torch.float32) if weight is None else torch.empty_like(weight))


@torch.library.custom_op("autoshard::layer_norm", mutates_args=())
def _ln(
    x: torch.Tensor, dims: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xf = _flat(x, dims)
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = ((xf - mean) * rstd).view(x.shape)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


@_ln.register_fake
def _(x, dims, weight, bias, eps):
    stat = x.new_empty((*x.shape[: x.dim() - dims], 1), dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


@torch.library.custom_op("autoshard::layer_norm_backward", mutates_args=())
def _ln_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    dims: int,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xhat = (_flat(x, dims) - mean) * rstd
    g = _flat(grad, dims)
    gw = (g * xhat).reshape(-1, xhat.size(-1)).sum(0)
    gb = g.reshape(-1, g.size(-1)).sum(0)
    if weight is not None:
        g = g * weight.float().reshape(-1)
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.view(x.shape).to(x.dtype), gw, gb


@_ln_backward.register_fake
def _(grad, x, dims, weight, mean, rstd):
    n = 1
    for d in x.shape[x.dim() - dims :]:
        n *= d
    stat = x.new_empty(n, dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


def _rms_save(ctx, inputs, output):
    x, dims, weight, eps = inputs
    ctx.dims, ctx.has_weight = dims, weight is not None
    ctx.save_for_backward(x, weight, output[1])


def _rms_grad(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, gw = torch.ops.autoshard.rms_norm_backward(grad, x, ctx.dims, weight, rstd)
    return dx, None, (gw.view(weight.shape).to(weight.dtype) if ctx.has_weight else None), None


def _ln_save(ctx, inputs, output):
    x, dims, weight, bias, eps = inputs
    ctx.dims, ctx.has_weight, ctx.has_bias = dims, weight is not None, bias is not None
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.bias_shape = None if bias is None else (bias.shape, bias.dtype)


def _ln_grad(ctx, grad, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, gw, gb = torch.ops.autoshard.layer_norm_backward(grad, x, ctx.dims, weight, mean, rstd)
    gw = gw.view(weight.shape).to(weight.dtype) if ctx.has_weight else None
    gb = gb.view(ctx.bias_shape[0]).to(ctx.bias_shape[1]) if ctx.has_bias else None
    return dx, None, gw, gb, None


_rms.register_autograd(_rms_grad, setup_context=_rms_save)
_ln.register_autograd(_ln_grad, setup_context=_ln_save)


def _dims(normalized_shape) -> int:
    return 1 if isinstance(normalized_shape, int) else len(normalized_shape)


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = None):
    """``F.rms_norm(x, normalized_shape, weight, eps)``, one op (see the module docstring)."""
    eps = torch.finfo(torch.float32).eps if eps is None else float(eps)  # torch's default, of the fp32 it runs in
    return torch.ops.autoshard.rms_norm(x, _dims(normalized_shape), weight, eps)[0]


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)``, one op (see the module docstring)."""
    return torch.ops.autoshard.layer_norm(x, _dims(normalized_shape), weight, bias, float(eps))[0]

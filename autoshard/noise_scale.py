"""The critical batch size (McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch
Training", arXiv 1812.06162). With a batch of B tokens a run needs about

    S = S_min (1 + B_noise / B) optimizer steps    and    E = E_min (1 + B / B_noise) tokens

to reach a given loss: below B_noise, doubling the batch nearly halves the steps at almost no
extra tokens; above it, doubling the batch saves less than half of the steps and spends up to
twice the tokens. The critical batch is about B_noise, which the paper approximates by the
simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (Sigma: the per-token gradient covariance,
G: the true gradient).

``critical_batch_note`` is what ``autoshard compile --noise-scale TOKENS`` says of a plan's
global batch. ``measure`` estimates B_simple on a model with the two-batch-size estimator of the
paper's appendix A: the expected squared norm of a batch-B gradient is ``|G|^2 + tr(Sigma)/B``,
so the norms at a small and a big batch give both unknowns, each averaged over batches before
their ratio is taken (the ratio of averages, as the paper advises: the ratio is biased where
either is noisy). ``autoshard verify --noise-scale`` runs it on the single-device model of an
emitted program, over a few of its steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------
# the model of large-batch training


def steps_factor(batch: float, noise_scale: float) -> float:
    """S / S_min at a batch of ``batch`` (the unit of ``noise_scale``)."""
    return 1 + noise_scale / batch


def tokens_factor(batch: float, noise_scale: float) -> float:
    """E / E_min at a batch of ``batch``."""
    return 1 + batch / noise_scale


def doubling_ratio(batch: float, noise_scale: float) -> float:
    """S(batch) / S(batch / 2): the share of the steps at half the batch that the whole batch
    still takes (1/2: doubling halves the steps; 1: doubling saves nothing)."""
    return steps_factor(batch, noise_scale) / steps_factor(batch / 2, noise_scale)


def critical_batch_note(global_batch: int, seq_len: int, noise_scale_tokens: float) -> tuple[bool, str]:
    """(whether the plan's global batch of ``global_batch`` sequences of ``seq_len`` tokens is
    past the critical batch B_noise = ``noise_scale_tokens``, what to tell the user)."""
    b = global_batch * seq_len
    ratio = doubling_ratio(b, noise_scale_tokens)
    head = (
        f"global batch {b:,} tokens ({global_batch} x {seq_len}) against a gradient noise scale of "
        f"{noise_scale_tokens:,.0f} tokens (--noise-scale)"
    )
    model = (
        f"by S = S_min (1 + B_noise/B), E = E_min (1 + B/B_noise) (McCandlish et al. 2018) this batch takes "
        f"{steps_factor(b, noise_scale_tokens):.2f} S_min steps and {tokens_factor(b, noise_scale_tokens):.2f} "
        f"E_min tokens; it takes {ratio:.2f} of the steps of half of it, so the second half of the batch saves "
        f"{(1 - ratio) * 100:.0f}% of the steps (a batch far below B_noise would save 50%)"
    )
    if b <= noise_scale_tokens:
        return False, f"Critical batch: {head}: within the critical batch; {model}."
    fits = max(1, round(noise_scale_tokens / seq_len))
    return True, (
        f"Critical batch (warning): {head}: the batch is {b / noise_scale_tokens:.1f}x the critical batch "
        f"B_crit ~ B_noise; {model}. The critical batch is about {fits} sequences per step (2 S_min steps, "
        "2 E_min tokens); a larger one buys fewer steps with more tokens."
    )


# ---------------------------------------------------------------------------------------------
# measuring B_simple


@dataclass
class NoiseScale:
    """The two-batch estimate over ``samples`` big batches: ``trace`` tr(Sigma) (per example of
    the batch unit), ``grad_sq`` |G|^2, ``b_simple`` their ratio (None where either came out
    non-positive: too few samples, the noise swamps the estimate), and ``spread`` the standard
    error of ``b_simple`` from the per-batch estimates (delta method)."""

    trace: float
    grad_sq: float
    b_simple: float | None
    samples: int
    small: int
    big: int
    spread: float | None = None


def estimate(norms: Sequence[tuple[float, float]], small: int, big: int) -> NoiseScale:
    """B_simple from (mean |G_small|^2, |G_big|^2) pairs, one per big batch of ``big`` examples
    cut into batches of ``small``."""
    if not 0 < small < big:
        raise ValueError(f"the small batch ({small}) must be smaller than the big one ({big})")
    traces = [(s - g) / (1 / small - 1 / big) for s, g in norms]
    grads = [(big * g - small * s) / (big - small) for s, g in norms]
    n = len(norms)
    trace, grad_sq = sum(traces) / n, sum(grads) / n
    b = trace / grad_sq if grad_sq > 0 and trace > 0 else None
    spread = None
    if b is not None and n > 1:  # var(T/G) ~ (var T - 2 b cov(T, G) + b^2 var G) / (n G^2)
        vt = sum((t - trace) ** 2 for t in traces) / (n - 1)
        vg = sum((g - grad_sq) ** 2 for g in grads) / (n - 1)
        cov = sum((t - trace) * (g - grad_sq) for t, g in zip(traces, grads)) / (n - 1)
        spread = math.sqrt(max(0.0, vt - 2 * b * cov + b * b * vg) / n) / grad_sq
    return NoiseScale(trace, grad_sq, b, n, small, big, spread)


def gradient_norms(
    params: Sequence[torch.Tensor], loss_of: Callable[[object], torch.Tensor], parts: Sequence[object]
) -> tuple[float, float]:
    """(mean over ``parts`` of the squared norm of each part's gradient, squared norm of their
    mean: the big batch's gradient, which is left in the parameters' ``.grad``). The parts are
    equal batches and ``loss_of`` a mean over its batch, so the mean of their gradients is the
    gradient of the whole."""
    total, small_sq = None, 0.0
    for part in parts:
        for p in params:
            p.grad = None
        loss_of(part).backward()
        g = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params])
        g = g.double()
        small_sq += float(g.square().sum())
        total = g if total is None else total.add_(g)
    mean = total / len(parts)
    at = 0
    for p in params:
        p.grad = mean[at : at + p.numel()].view_as(p).to(p.dtype)
        at += p.numel()
    return small_sq / len(parts), float(mean.square().sum())


def measure(
    params: Sequence[torch.Tensor],
    loss_of: Callable[[object], torch.Tensor],
    batches: Iterable[object],
    small: int,
    step: Callable[[], None] | None = None,
) -> NoiseScale:
    """B_simple over ``batches`` (each a tensor or a tuple of tensors, examples along the first
    dimension, all of one size), each cut into batches of ``small`` examples; ``step`` (if given)
    runs after each batch with its whole gradient in ``.grad`` (an optimizer step: a short run)."""
    norms, big = [], None
    for batch in batches:
        parts = _split(batch, small)
        size = _size(batch)
        if big is not None and size != big:
            raise ValueError(f"batches of {big} and {size} examples: give batches of one size")
        big = size
        norms.append(gradient_norms(params, loss_of, parts))
        if step is not None:
            step()
    if big is None:
        raise ValueError("no batches to measure the noise scale on")
    return estimate(norms, small, big)


def _size(batch) -> int:
    return (batch[0] if isinstance(batch, (tuple, list)) else batch).size(0)


def _split(batch, small: int) -> list:
    if _size(batch) % small:
        raise ValueError(f"a batch of {_size(batch)} examples does not split into batches of {small}")
    if isinstance(batch, (tuple, list)):
        return list(zip(*(t.split(small) for t in batch)))
    return list(batch.split(small))

"""LAMB (You et al., "Large Batch Optimization for Deep Learning", arXiv 1904.00962): AdamW's
moments and bias correction, then a per-tensor trust ratio. For each parameter tensor ``w``:

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
    r = ||w|| / ||u||  (1 where either norm is 0)
    w = w - lr r u

The norms are the WHOLE tensor's, wherever its pieces lie (TP and EP slices, ZeRO-1 rows, FSDP
shards): a step is therefore two passes. ``prepare`` updates the moments and returns each
tensor's local squared norms of ``w`` and ``u``; the caller sums them over the ranks holding the
tensor's pieces (``state.trust_norms``: one all-reduce for the whole program; on one device,
nothing) and ``apply`` makes ``u`` again from the moments (bit for bit the same: it is not kept,
so LAMB needs no memory beyond AdamW's) and steps. ``Lamb.step`` is both passes with local norms:
the single-device optimizer the verification compares the program against.

The states are AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints save and restore
them as AdamW's. A parameter in a precision below fp32 is stepped through an fp32 master copy
this optimizer keeps (``masters``; ``write_back`` rounds them into the parameters), as
``program.MasterAdamW`` does for AdamW. FSDP2's parameters are DTensors: every pass works on
their local shards.
"""

from __future__ import annotations

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||^2`` as an fp64 scalar (the norm in fp32, as ``clip_grad_norm_``'s: no fp64 copy)."""
    return torch.linalg.vector_norm(t).double().square()


def trust_ratio(w_norm: float, u_norm: float) -> float:
    """``||w|| / ||u||``, or 1 where either is 0 (a zero-initialised bias, a zero update)."""
    return w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0


class Masters:
    """fp32 master copies of an optimizer's low-precision parameters (``masters``, by parameter
    id), made after the optimizer's own ``__init__`` by ``_make_masters``: LAMB and the program's
    ``MasterAdamW`` step those and round them back."""

    masters: dict[int, torch.Tensor]

    def _make_masters(self) -> None:
        self.masters = {}
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.is_floating_point() and p.dtype != torch.float32:
                        self.masters[id(p)] = p.detach().float()

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor stepped for ``p`` (and keying its states): its fp32 master, or ``p``."""
        return self.masters.get(id(p), p)


class Lamb(Masters, torch.optim.Optimizer):
    """LAMB over ``params`` (see the module docstring). ``fused`` is accepted and ignored (the
    program asks AdamW for it on GPUs)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 fused: bool | None = None):  # fmt: skip
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self._make_masters()

    def _stepped(self):
        """(group, parameter, the tensor stepped for it, its fp32 gradient) of every parameter with one."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    yield group, p, self.master(p), _local(p.grad).float()

    def _update(self, group: dict, w: torch.Tensor) -> torch.Tensor:
        """``u`` of the stepped tensor ``w`` (local) from its moments, as of the last ``prepare``."""
        st = self.state[w]
        b1, b2 = group["betas"]
        t = float(st["step"])
        m_hat = _local(st["exp_avg"]) / (1 - b1**t)
        v_hat = _local(st["exp_avg_sq"]) / (1 - b2**t)
        return m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * _local(w)

    @torch.no_grad()
    def prepare(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Pass one: every stepped tensor's moments updated; returns (stepped tensor, this rank's
        sum of squares of its ``w``, of its ``u``), both fp64 scalars."""
        out = []
        for group, _, w, g in self._stepped():
            st = self.state[w]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(w, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(w, memory_format=torch.preserve_format)
            b1, b2 = group["betas"]
            st["step"] += 1
            _local(st["exp_avg"]).lerp_(g, 1 - b1)
            _local(st["exp_avg_sq"]).mul_(b2).addcmul_(g, g, value=1 - b2)
            u = self._update(group, w)
            out.append((w, _square_norm(_local(w)), _square_norm(u)))
        return out

    @torch.no_grad()
    def apply(self, norms: dict[int, tuple[float, float]]) -> None:
        """Pass two: ``w -= lr r u`` with ``r`` from ``norms`` (id of stepped tensor -> its whole
        ``(||w||, ||u||)``), then the masters rounded into their parameters."""
        for group, p, w, _ in self._stepped():
            r = trust_ratio(*norms[id(w)])
            _local(w).add_(self._update(group, w), alpha=-group["lr"] * r)
            if w is not p:
                p.copy_(w)

    @torch.no_grad()
    def step(self, closure=None):
        """One step with each tensor's norms its own (a single device: every tensor whole)."""
        loss = closure() if closure is not None else None
        self.apply({id(w): (float(ws.sqrt()), float(us.sqrt())) for w, ws, us in self.prepare()})
        return loss

    def write_back(self) -> None:
        """Round the masters into the parameters (after a checkpoint loaded into the masters)."""
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    m = self.masters.get(id(p))
                    if m is not None:
                        p.copy_(m)

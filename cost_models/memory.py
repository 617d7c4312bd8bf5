"""Model-state memory: mixed-precision Adam and ZeRO (Rajbhandari et al., arXiv 1910.02054).

Per parameter: bf16 weights 2 B, bf16 gradients 2 B, fp32 master weights 4 B, Adam moments 4 + 4 B
= 16 B. ZeRO-1 shards the optimizer's 12 B over the data-parallel ranks, ZeRO-2 the gradients as
well, ZeRO-3 the weights too. ``program_state_bytes`` is what autoshard's programs hold of them.
"""

from __future__ import annotations

from functools import lru_cache

WEIGHT_BYTES = 2
GRAD_BYTES = 2
GRAD_REDUCE_BYTES = 4  # fp32 gradients: how autoshard's programs accumulate and reduce them
OPTIMIZER_BYTES = 12  # fp32 master copy + Adam m + Adam v
MASTER_BYTES = 4  # the fp32 master copy, of OPTIMIZER_BYTES
# a bf16 parameter's gradient as backward makes it: the bf16 gradient and its fp32 copy, added into
# the fp32 gradient (``grad_dtype``), for one parameter at a time
GRAD_TRANSIENT_BYTES = 2 + 4
# ZeRO-3 (FSDP2) holds at its peak three bf16 copies of a layer's weights: the layer at work, the
# next one's all-gather output, and the copy it makes out of that into the next layer's parameters
# (it lets go of a gather's output when the next gather starts)
ZERO3_GATHERED_LAYERS = 3
BYTES_PER_PARAM = WEIGHT_BYTES + GRAD_BYTES + OPTIMIZER_BYTES


def model_state_bytes(params: float, zero: int = 0, dp: int = 1, grad_bytes: int = GRAD_BYTES) -> dict[str, float]:
    """Bytes per GPU for ``params`` parameters replicated over ``dp`` ranks at ZeRO stage ``zero``.
    ``grad_bytes`` is 2 for bf16 gradients (the 16 B/param rule) and 4 when gradients accumulate
    and reduce in fp32, as LLaMA-3 did and autoshard's emitted programs do."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {zero}")
    shard = lambda stage: dp if zero >= stage else 1  # noqa: E731
    out = {
        "params": params * WEIGHT_BYTES / shard(3),
        "grads": params * grad_bytes / shard(2),
        "optimizer": params * OPTIMIZER_BYTES / shard(1),
    }
    out["total"] = sum(out.values())
    return out


def program_state_bytes(params: float, zero: int, ranks: int) -> dict[str, float]:
    """``model_state_bytes`` with fp32 gradients as autoshard's programs hold them: where FSDP2
    shards (ZeRO-2/3 over more than one rank) its fp32 shards are the masters the optimizer
    steps, held as the parameters (``runtime.program.shard_data_parallel``); beside them ZeRO-3
    keeps no weights (a layer's bf16 ones are gathered while it works: ``ZERO3_GATHERED_LAYERS``)
    and ZeRO-2 the bf16 weights whole, from a layer's forward until its backward."""
    out = model_state_bytes(params, zero, ranks, GRAD_REDUCE_BYTES)
    if zero >= 2 and ranks > 1:
        masters = params * MASTER_BYTES / ranks
        out["params"] = (params * WEIGHT_BYTES if zero == 2 else 0.0) + masters
        out["optimizer"] -= masters
        out["total"] = sum(out[k] for k in ("params", "grads", "optimizer"))
    return out


@lru_cache(maxsize=65536)
def sharded_state_bytes(params_dense: float, params_expert: float, zero: int, dpcp: int, edp: int) -> dict[str, float]:
    """Model states per GPU holding ``params_dense`` dense and ``params_expert`` routed-expert
    parameters (``program_state_bytes``). ZeRO shards a parameter's states over the ranks that
    hold the same copy of it: the dense ones over the ``dpcp`` data x context parallel ranks (TP
    ranks hold different slices), the experts over their ``edp`` expert-data-parallel ranks (a
    stage's tp*cp*dp ranks over ``ep``: each expert-parallel rank holds whole experts, 1/ep of
    them), at every stage as the program does (ZeRO-1's rows; FSDP2 over that group at 2/3)."""
    dense = program_state_bytes(params_dense, zero, dpcp)
    expert = program_state_bytes(params_expert, zero, edp)
    return {k: dense[k] + expert[k] for k in dense}


def stepped_params(params_dense: float, params_expert: float, zero: int, dpcp: int, edp: int) -> float:
    """Parameters one rank's optimizer steps, of the ``params_dense`` and ``params_expert`` it
    holds (``sharded_state_bytes``): from ZeRO-1 on, its shard of each over the ranks holding the
    same copy; at ZeRO-0 all of them."""
    if zero == 0:
        return params_dense + params_expert
    return params_dense / dpcp + params_expert / edp

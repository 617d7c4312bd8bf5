"""``autoshard inspect``: what a captured model is, in numbers a person can check."""

from __future__ import annotations

from autoshard.cost_models.analyze import CATEGORIES, ModelCost
from autoshard.ir import B, S


def _ranges(layers: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            parts.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def inspect_model(cost: ModelCost, seq: int, float_bytes: int = 2) -> dict:
    """Parameters, FLOPs per token, per-layer activation bytes (micro-batch 1, ``seq`` tokens,
    16-bit activations, no parallelism, nothing recomputed), op classes and layer structure."""
    cap = cost.captured
    per_token = cost.flops_per_token(seq)
    kinds = []
    for blk in cost.blocks:
        per_cat = blk.saved_bytes(1, seq, float_bytes)
        module = _module_type(cost, blk.layers[0])
        kinds.append(
            {
                "kind": len(kinds),
                "module": module,
                "count": blk.count,
                "layers": _ranges(blk.layers),
                "params_per_layer": blk.params,
                "flops_per_token_per_layer": blk.eval("flops", 1, seq) / seq,
                "activation_bytes": sum(per_cat.values()),
                "activation_bytes_by_category": {c: v for c, v in per_cat.items() if v},
            }
        )
    per_layer = [0.0] * cost.num_layers
    for blk, info in zip(cost.blocks, kinds):
        for layer in blk.layers:
            per_layer[layer] = info["activation_bytes"]
    totals: dict[str, float] = {}
    for blk in cost.all_blocks():
        for cls, expr in blk.flops_by_class.items():
            totals[cls] = totals.get(cls, 0.0) + blk.count * _eval(expr, seq)
    fwd_total = sum(totals.values()) or 1.0
    return {
        "params": cost.params,
        "params_by_region": {
            "embedding": cost.pre.params,
            "layers": sum(b.params * b.count for b in cost.blocks),
            "output": cost.post.params,
        },
        "seq_len": seq,
        "flops_per_token": per_token,
        "layers": cost.num_layers,
        "layer_stack": cap.stack_path,
        "layer_kinds": kinds,
        "activation_bytes_per_layer": per_layer,
        "output_activation_bytes": sum(cost.post.saved_bytes(1, seq, float_bytes).values()),
        "op_classes": {
            cls: {"flops_per_token": v / seq, "share": v / fwd_total}
            for cls, v in sorted(totals.items(), key=lambda kv: -kv[1])
            if v
        },
        "tracer": cap.tracer,
        "notes": list(cap.notes),
        "nodes": len(cap.graph_module.graph.nodes),
    }


def _eval(expr, seq: int) -> float:
    return float(expr.subs({B: 1, S: seq})) if expr.free_symbols else float(expr)


def _module_type(cost: ModelCost, layer: int) -> str:
    for n in cost.captured.layer_nodes.get(layer, []):
        path = n.meta.get("module_path", "")
        if path.count(".") <= (cost.captured.stack_path or "").count(".") + 1:
            return n.meta.get("module_type", "")
    return ""


def _si(x: float, unit: str = "") -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {p}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def format_inspection(info: dict, title: str) -> str:
    lines = [f"{title}: {_si(info['params'])} parameters ({info['params']:,}), traced with {info['tracer']}"]
    r = info["params_by_region"]
    lines.append(f"  embedding {_si(r['embedding'])}, layers {_si(r['layers'])}, output {_si(r['output'])}")
    f = info["flops_per_token"]
    lines.append(
        f"FLOPs per token at seq {info['seq_len']}: forward {_si(f['forward'], 'FLOP')}, "
        f"training {_si(f['training'], 'FLOP')} (forward + 2x backward)"
    )
    lines.append(f"Layers: {info['layers']} in '{info['layer_stack']}', {len(info['layer_kinds'])} kind(s)")
    for k in info["layer_kinds"]:
        lines.append(
            f"  kind {k['kind']} ({k['module']}) x{k['count']} [layers {k['layers']}]: "
            f"{_si(k['params_per_layer'])} params, {_si(k['flops_per_token_per_layer'], 'FLOP')}/token, "
            f"activations {_si(k['activation_bytes'], 'B')} per layer"
        )
        cats = ", ".join(f"{c} {_si(v, 'B')}" for c, v in k["activation_bytes_by_category"].items())
        lines.append(f"      saved for backward: {cats}")
    lines.append(
        f"Activation bytes per layer: micro-batch 1, {info['seq_len']} tokens, 16-bit, no parallelism; "
        f"output head and loss keep {_si(info['output_activation_bytes'], 'B')}"
    )
    lines.append("Forward FLOPs by op class:")
    for cls, v in info["op_classes"].items():
        lines.append(f"  {cls:12s} {v['share'] * 100:6.2f}%  {_si(v['flops_per_token'], 'FLOP')}/token")
    lines.extend(f"Assumed: {note}" for note in info.get("notes", []))
    return "\n".join(lines)


__all__ = ["inspect_model", "format_inspection", "CATEGORIES"]

"""The dtype flow of a model whose parameters are bf16, recovered for a graph traced in fp32.

torch.export traces a model at the dtypes it is built with (fp32), and there a model's casts
lose what they meant:

- a cast to the parameters' dtype (transformers' ``h.to(input_dtype)`` at the end of an RMS
  norm, ``cos.to(x.dtype)`` of the rotary tables, ``routing_weights.to(hidden_states.dtype)``) is
  recorded as a cast to fp32, so the bf16 program would keep those tensors in fp32;
- a cast that changes nothing returns its input, so the tensor before it and the cast are one
  tensor while tracing, and every later reader of the tensor is recorded as reading the cast:
  transformers' RMSNorm begins with ``hidden_states.to(torch.float32)``, and the residual add
  after the layer reads that fp32 copy where the model reads the bf16 residual stream. A bf16
  program so traced carries an fp32 residual stream: twice the bytes of every residual, of every
  activation a pipeline stage hands on and of every expert all-to-all's gradient.

:func:`follow` compares the fp32 graph with a second trace of the same model whose parameters are
bf16 (``lowered``: same ops in the same order; the tracer chose the same path), node by node:
where the bf16 graph reads a cast's input and the fp32 graph reads the cast, the fp32 graph is
rewired to read the input; where a cast targets fp32 in one and bf16 in the other, it becomes
``to_compute`` (the program's compute dtype: bf16 under autocast, fp32 in an fp32 run). Casts to
fp32 in both (a norm's statistics, a softmax's logits, the loss) stay. The graph then computes
in a bf16 program what the model computes with bf16 parameters, and in an fp32 program what it
computes in fp32.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.ir import ops
from autoshard.runtime.stages import to_compute


@contextlib.contextmanager
def lowered(model: nn.Module):
    """A context in which ``model`` lives on the meta device with its floating parameters bf16
    (buffers keep their dtypes, as the program keeps them; a tied parameter stays one): each
    module's parameters and buffers are swapped for meta tensors, and put back on exit, so a live
    model is neither copied nor changed."""
    swapped: dict[int, nn.Parameter] = {}
    saved = []
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in swapped:
                        dtype = torch.bfloat16 if t.is_floating_point() and table is module._parameters else t.dtype
                        meta = torch.empty(t.shape, dtype=dtype, device="meta")
                        swapped[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                    saved.append((table, name, t))
                    table[name] = swapped[id(t)]
        yield
    finally:
        for table, name, t in saved:
            table[name] = t


def _aligned(gm: fx.GraphModule, low: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]] | None:
    """The two graphs' nodes side by side, or None where they are not the same ops in the same
    order (a grouped GEMM may be another op of the same family: transformers picks its kernel by
    dtype)."""
    a, b = list(gm.graph.nodes), list(low.graph.nodes)
    if len(a) != len(b):
        return None
    for x, y in zip(a, b):
        if x.op != y.op:
            return None
        if x.op == "call_function":
            nx, ny = ops.op_name(x), ops.op_name(y)
            if nx != ny and not ("grouped_mm" in nx and "grouped_mm" in ny):
                return None
    return list(zip(a, b))


def follow(gm: fx.GraphModule, low: fx.GraphModule) -> bool:
    """Rewrite ``gm`` (traced in fp32) in place to the dtype flow of ``low`` (the same model
    traced with bf16 parameters), as the module docstring says. Nothing changes where the graphs
    are not aligned. Whether anything changed."""
    pairs = _aligned(gm, low)
    if pairs is None:
        return False
    mine = {y: x for x, y in pairs}
    rewire: list[tuple[fx.Node, list]] = []
    relative: list[fx.Node] = []
    for x, y in pairs:
        fx_args, spec = tree_flatten((x.args, x.kwargs))
        fy_args, _ = tree_flatten((y.args, y.kwargs))
        if len(fx_args) != len(fy_args):
            return False
        changed = list(fx_args)
        for i, (u, v) in enumerate(zip(fx_args, fy_args)):
            if isinstance(u, fx.Node) and isinstance(v, fx.Node):
                if mine[v] is u:
                    continue
                # the model reads the cast's input; the trace recorded the cast (it returned its input)
                if ops.cast_target(u) is not None and u.args and mine[v] is u.args[0]:
                    changed[i] = u.args[0]
                    continue
                return False
            if u is torch.float32 and v is torch.bfloat16 and ops.cast_target(x) is not None:
                relative.append(x)
            elif type(u) is not type(v):
                return False
        if changed != fx_args:
            rewire.append((x, tree_unflatten(changed, spec)))
    for x, (args, kwargs) in rewire:
        x.args, x.kwargs = args, kwargs
    graph = gm.graph
    for x in relative:
        with graph.inserting_before(x):
            cast = graph.call_function(to_compute, (x.args[0],))
        cast.meta = dict(x.meta)
        x.replace_all_uses_with(cast)
        graph.erase_node(x)
    if rewire or relative:
        graph.lint()
        gm.recompile()
    return bool(rewire or relative)

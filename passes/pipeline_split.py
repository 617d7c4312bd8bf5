"""Pipeline split: one sub-graph per pipeline chunk (virtual stage) following the Plan's
``stage_layers``, plus the loss as its own graph, with every boundary tensor explicit.

Nodes of repeated layer ``L`` go to the chunk whose layer range holds ``L``; what comes before the
layer stack (embeddings) to chunk 0, what comes after it inside the model (final norm, output head)
to the last chunk, and what the training wrapper adds after the model (the loss) to the loss graph,
which the pipeline runtime calls as ``loss_fn(output, target)`` on the last chunk's output and the
micro-batch's token ids. A chunk's inputs are exactly the previous chunk's outputs: values a later
chunk needs are passed through the chunks in between, so each boundary is one explicit tuple.
Reads of a model input's size or device carry no data: each chunk that needs one reads it again,
off its own inputs. A parameter is never a boundary value either: each chunk that reads it holds it.
A parameter several chunks read (the token embedding tied to the output head: Gemma, GPT-2, small
Llama and Qwen models) is one parameter held as a copy by each of them, read under one name (its
first, the one ``named_parameters`` gives); ``SplitProgram.tied`` records its names and the chunks
holding it, from which the program sums the copies' gradients (Megatron's embedding group).

Requires the canonical graph (``autoshard.passes.canonicalize``: no export guards, no device
constants) with ``region`` and ``layer`` on every node, and reads ``ctx.stage_layers``. Leaves
``gm`` as it is and sets ``decisions(gm).split`` to the :class:`SplitProgram`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import accumulate

from torch import fx

from autoshard import runtime
from autoshard.errors import AutoshardError
from autoshard.passes._graph import in_model as _in_model
from autoshard.passes.contract import Refusal, RewriteContext, decisions

LOSS = -1


@dataclass
class SplitProgram:
    chunks: list[fx.GraphModule]
    loss: fx.GraphModule
    boundaries: list[list[str]] = field(default_factory=list)  # names of each chunk's outputs
    layers: list[tuple[int, int]] = field(default_factory=list)  # [first, last) layer of each chunk
    target: str | None = None  # the model input the loss reads (the token ids)
    # each parameter with several names or several holding chunks: {"names": the name the chunks
    # hold first, then the model's other names for it; "chunks": the chunks holding a copy}
    tied: list[dict] = field(default_factory=list)


def _refuse(why: str) -> Refusal:
    """What the model does that no pipeline split can carry: every pipeline degree above 1 is
    refused, so the search plans without pipelining instead of failing."""
    return Refusal(f"pipeline parallelism cannot split this model: {why}; plan with --force pp=1", axis="pp")


def _input_size(node: fx.Node) -> bool:
    """``x.size(d)`` / ``sym_size(x, d)`` of a model input, or a symbolic size of any tensor (the
    sequence length of context parallelism's shard of the tokens): recomputed wherever it is
    read, from the tensor where the chunk has it, else from an input of the chunk with that
    extent. A pipeline stage sends tensors only."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if not name.startswith(("size", "sym_size")) or not isinstance(node.args[0], fx.Node):
        return False
    if node.args[0].op == "placeholder":
        return True
    shape, dim = node.args[0].meta.get("shape"), node.args[1] if len(node.args) > 1 else None
    return isinstance(dim, int) and isinstance(shape, (tuple, list)) and bool(getattr(shape[dim], "free_symbols", None))


def _input_device(node: fx.Node) -> bool:
    """``x.device`` of a model input (canonicalize reads the device for factory calls so)."""
    return (
        node.op == "call_function"
        and node.target is getattr
        and node.args[1:] == ("device",)
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "placeholder"
    )


_SCALAR_OPS = {operator.mul, operator.add, operator.sub, operator.floordiv, operator.neg}


def _input_arith(node: fx.Node, meta: set[fx.Node]) -> bool:
    """Integer arithmetic over model input sizes (``b * s`` for flattening tokens into rows, as
    transformers' MoE blocks compute it once for all layers), given ``meta``, the earlier nodes
    that are such reads: recomputed wherever it is read, never handed between chunks (a pipeline
    stage sends tensors only)."""
    if node.op != "call_function" or node.target not in _SCALAR_OPS:
        return False
    args = [a for a in node.args if isinstance(a, fx.Node)]
    return bool(args) and all(a in meta for a in args) and all(isinstance(a, (fx.Node, int)) for a in node.args)


def input_meta_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The reads of a model input's size or device, and arithmetic on its sizes: recomputed
    wherever they are read. One walk in graph order (an argument comes before its users), so a
    graph of any depth costs one visit per node."""
    meta: set[fx.Node] = set()
    for node in graph.nodes:
        if _input_size(node) or _input_device(node) or _input_arith(node, meta):
            meta.add(node)
    return meta


def _names(gm: fx.GraphModule) -> dict[int, list[str]]:
    """id of each parameter of ``gm`` -> its names, in ``named_parameters`` order."""
    names: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def tied_parameters(gm: fx.GraphModule) -> list[list[str]]:
    """The names of each parameter ``gm`` holds under several (tied weights), the one
    ``named_parameters`` gives first: the name every chunk holding it reads it by."""
    return [tied for tied in _names(gm).values() if len(tied) > 1]


def held_names(gm: fx.GraphModule) -> dict[str, str]:
    """Each name of a tied parameter -> the name chunks read it by (its first)."""
    return {name: tied[0] for tied in tied_parameters(gm) for name in tied}


def _parameter_read(node: fx.Node) -> bool:
    """A read of a parameter or buffer that some node uses: copied into every chunk using it."""
    return node.op == "get_attr" and bool(node.users)


def assign_chunks(gm: fx.GraphModule, stage_layers: list[int]) -> dict[fx.Node, int]:
    """Node -> chunk index (``LOSS`` for the loss graph); placeholders and parameter reads are
    absent (each chunk reading a parameter reads it itself). An unused read of a tied parameter's
    other name is dropped; an unused read of a layer's buffer goes with its layer; any other
    unused read stays in chunk 0."""
    bounds = list(accumulate(stage_layers))
    last = len(stage_layers) - 1

    def chunk_of_layer(layer: int) -> int:
        return next(c for c, end in enumerate(bounds) if layer < end)

    held = held_names(gm)
    used = {held.get(n.target, n.target) for n in gm.graph.nodes if _parameter_read(n)}
    meta = input_meta_nodes(gm.graph)
    out: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node in meta or _parameter_read(node):
            continue
        if node.op == "get_attr":
            if held.get(node.target, node.target) not in used:
                layer = node.meta.get("layer") if node.meta.get("region") == "layer" else None
                out[node] = 0 if layer is None else chunk_of_layer(layer)
            continue
        if not _in_model(node):
            out[node] = LOSS
        elif node.meta.get("region") == "layer" and node.meta.get("layer") is not None:
            if node.meta["layer"] >= bounds[-1]:
                raise AutoshardError(
                    f"the plan's stage_layers hold {bounds[-1]} layers but the model has layer {node.meta['layer']}; "
                    "recompile the plan for this model"
                )
            out[node] = chunk_of_layer(node.meta["layer"])
        elif node.meta.get("region") == "post":
            out[node] = last
        else:
            out[node] = 0
    return out


def pipeline_split(gm: fx.GraphModule, ctx: RewriteContext) -> fx.GraphModule:
    """Split ``gm`` into the chunks ``ctx.stage_layers`` gives (one chunk holding every layer when
    it is empty) and the loss; sets ``decisions(gm).split`` and returns ``gm`` unchanged."""
    decisions(gm).split = split_program(gm, list(ctx.stage_layers) or [_num_layers(gm)])
    return gm


def chunks_chained(gm: fx.GraphModule, ctx: RewriteContext) -> str | None:
    """``ensures`` of the pass: one chunk per entry of ``stage_layers``, each holding only its
    layers, each reading exactly what the chunk before it hands on, and the loss reading what the
    last one hands on. Returns what is wrong, or None."""
    split = decisions(gm).split
    if not isinstance(split, SplitProgram):
        return f"decisions(gm).split is {type(split).__name__}, not a SplitProgram"
    want = list(ctx.stage_layers) or [_num_layers(gm)]
    if len(split.chunks) != len(want):
        return f"{len(split.chunks)} chunks for stage_layers {want}"
    for c, (chunk, (first, end)) in enumerate(zip(split.chunks, split.layers)):
        inputs = [v.name for v in chunk.graph.nodes if v.op == "placeholder"]
        if c > 0 and inputs != split.boundaries[c - 1]:
            return f"chunk {c} reads {inputs} but chunk {c - 1} hands on {split.boundaries[c - 1]}"
        (output,) = [v for v in chunk.graph.nodes if v.op == "output"]
        handed = output.args[0] if isinstance(output.args[0], tuple) else (output.args[0],)
        if len(handed) != len(split.boundaries[c]):
            return f"chunk {c} returns {len(handed)} values but hands on {split.boundaries[c]}"
        # a node of region "layer" without a layer index (one a pass inserted) goes to chunk 0
        computed = [v for v in chunk.graph.nodes if v.op != "placeholder"]
        held = {v.meta.get("layer") for v in computed if v.meta.get("region") == "layer"}
        stray = sorted(held - {None} - set(range(first, end)))
        if stray:
            return f"chunk {c} holds layers {stray}, outside its [{first}, {end})"
    loss_inputs = [v.name for v in split.loss.graph.nodes if v.op == "placeholder"]
    if loss_inputs[: len(split.boundaries[-1])] != split.boundaries[-1]:
        return f"the loss reads {loss_inputs} but the last chunk hands on {split.boundaries[-1]}"
    return None


def _num_layers(gm: fx.GraphModule) -> int:
    return 1 + max((n.meta["layer"] for n in gm.graph.nodes if n.meta.get("layer") is not None), default=-1)


def split_program(gm: fx.GraphModule, stage_layers: list[int]) -> SplitProgram:
    """The chunks holding ``stage_layers[c]`` layers each, in order, and the loss graph."""
    chunk = assign_chunks(gm, stage_layers)
    held = held_names(gm)
    n = len(stage_layers)
    meta = input_meta_nodes(gm.graph)
    nodes = [n for n in gm.graph.nodes if n not in meta and not _parameter_read(n)]
    placeholders = [p for p in nodes if p.op == "placeholder"]
    _check_reads_go_forward(nodes, chunk, meta, n)
    reads_after = _handed_on(nodes, chunk, n)
    loss_inputs = _loss_inputs(placeholders, chunk)
    chunks = []
    for c in range(n):
        inputs = [p for p in placeholders if any(chunk.get(u) == 0 for u in p.users)] if c == 0 else reads_after[c - 1]
        if c == 0:
            inputs = [p for p in placeholders if p in inputs or p in reads_after[0]]
        mine = [v for v in nodes if chunk.get(v) == c]
        chunks.append(_subgraph(gm, inputs, mine, reads_after[c], f"Chunk{c}", held, meta))
    loss_nodes = [v for v in nodes if chunk.get(v) == LOSS]
    loss = _subgraph(gm, reads_after[-1] + loss_inputs, loss_nodes, None, "Loss", held, meta)
    layers = list(zip([0, *accumulate(stage_layers)][:-1], accumulate(stage_layers)))
    return SplitProgram(
        chunks,
        loss,
        [[v.name for v in r] for r in reads_after],
        layers,
        loss_inputs[0].name if loss_inputs else None,
        _ties(gm, chunks),
    )


def _check_reads_go_forward(nodes: list[fx.Node], chunk: dict[fx.Node, int], meta: set[fx.Node], n: int) -> None:
    """Every value a chunk reads comes from it or an earlier one, and the loss reads only the
    last chunk's; what every chunk holds (inputs, their sizes, parameters) is read anywhere."""
    for node in nodes:
        for arg in node.all_input_nodes:
            held_by_each = arg.op == "placeholder" or arg in meta or _parameter_read(arg)
            if held_by_each or node.op == "output" or node not in chunk:
                continue
            a, b = chunk[arg], chunk[node]
            if b == LOSS and a not in (LOSS, n - 1):
                raise _refuse(f"the loss reads {arg.name} from pipeline chunk {a}, not the last one")
            if a != LOSS and b != LOSS and a > b:
                raise _refuse(f"{node.name} in chunk {b} reads {arg.name} from the later chunk {a}")


def _handed_on(nodes: list[fx.Node], chunk: dict[fx.Node, int], n: int) -> list[list[fx.Node]]:
    """The values each of the ``n`` chunks hands on: produced at or before it, read after it
    (model inputs first, then computed values in program order)."""
    placeholders = [p for p in nodes if p.op == "placeholder"]
    computed = [v for v in nodes if v.op != "placeholder"]
    reads_after: list[list[fx.Node]] = []
    for c in range(n):
        needed = []
        for v in [*placeholders, *computed]:
            if v.op == "output" or (v.op != "placeholder" and chunk.get(v, 0) > c) or chunk.get(v) == LOSS:
                continue
            later = [u for u in v.users if u in chunk and (chunk[u] > c or (chunk[u] == LOSS and c == n - 1))]
            if v.op == "placeholder":  # the loss takes model inputs as its target, not from the pipeline
                later = [u for u in later if chunk[u] != LOSS]
            if later:
                needed.append(v)
        reads_after.append(needed)
    return reads_after


def _loss_inputs(placeholders: list[fx.Node], chunk: dict[fx.Node, int]) -> list[fx.Node]:
    """The model input the loss reads as its target (directly or through its size): one at most."""

    def read_by_loss(p: fx.Node) -> bool:
        return any(
            chunk.get(u) == LOSS or (_input_size(u) and any(chunk.get(w) == LOSS for w in u.users)) for u in p.users
        )

    loss_inputs = [p for p in placeholders if read_by_loss(p)]
    if len(loss_inputs) > 1:
        names = ", ".join(p.name for p in loss_inputs)
        raise _refuse(f"the loss reads {len(loss_inputs)} model inputs ({names}); the pipeline hands it one target")
    return loss_inputs


def _ties(gm: fx.GraphModule, chunks: list[fx.GraphModule]) -> list[dict]:
    """Each parameter that is tied (several names) or held by several chunks: its names, the one
    the chunks hold first, and the chunks holding a copy."""
    names = _names(gm)
    holders: dict[int, list[int]] = {}
    for c, chunk in enumerate(chunks):
        for p in chunk.parameters():
            holders.setdefault(id(p), []).append(c)
    return [{"names": names[i], "chunks": cs} for i, cs in holders.items() if len(names[i]) > 1 or len(cs) > 1]


def _subgraph(gm, inputs, body, outputs, name, held: dict[str, str], meta: set[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in inputs:
        env[v] = graph.placeholder(v.name)
        env[v].meta = dict(v.meta)

    def lookup(a: fx.Node) -> fx.Node:
        if a not in env and _parameter_read(a):  # every chunk reading a parameter holds it
            env[a] = graph.get_attr(held.get(a.target, a.target))
            env[a].meta = dict(a.meta)
        if a not in env and a in meta:
            if _input_arith(a, meta):  # recomputed here: belongs to no layer of this chunk
                env[a] = graph.node_copy(a, lookup)
                env[a].meta.pop("layer", None)
            elif a.args[0] in env:
                env[a] = graph.node_copy(a, lambda x: env[x])
            elif _input_device(a):
                env[a] = _device_from_inputs(graph, env, a, name)
            else:
                env[a] = _size_from_inputs(graph, env, a, name)
        return env[a]

    for v in body:
        env[v] = graph.node_copy(v, lookup)
    if outputs is None:  # the loss graph returns what the original graph returned
        (result,) = [v for v in gm.graph.nodes if v.op == "output"]
        graph.output(fx.map_arg(result.args[0], lambda a: env[a]))
    else:
        graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[v] for v in outputs))
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=name)


def _device_from_inputs(graph: fx.Graph, env: dict, read: fx.Node, name: str) -> fx.Node:
    """A later chunk creates a tensor on the device of a model input it does not have: its own
    inputs are on that device."""
    first = next((node for node in env.values() if node.op == "placeholder"), None)
    if first is None:
        raise _refuse(f"{name} creates a tensor on the device of {read.args[0].name} and has no input")
    return graph.call_function(getattr, (first, "device"))


def _size_from_inputs(graph: fx.Graph, env: dict, size: fx.Node, name: str) -> fx.Node:
    """A later chunk reads the batch or sequence length of a model input it does not have: read it
    off one of its own inputs with that symbolic dimension (times the TP degree where sequence
    parallelism has sliced that dimension)."""
    import operator

    dim = size.args[1] if len(size.args) > 1 else 0
    want = size.args[0].meta["shape"][dim]
    best = None
    for original, node in env.items():
        if node.op != "placeholder" or not isinstance(original.meta.get("shape"), (tuple, list)):
            continue
        for d, extent in enumerate(original.meta["shape"]):
            if extent == want and getattr(want, "free_symbols", None):
                sliced = original.meta.get("sp_sliced_dim") == d
                if best is None or (best[2] and not sliced):
                    best = (node, d, sliced, original.meta.get("sp_tp", 1))
    if best is None:
        raise _refuse(f"{name} reads the size of model input {size.args[0].name}, which only the first chunk has")
    node, d, sliced, tp = best

    out = graph.call_function(runtime.size_of, (node, d))
    return graph.call_function(operator.mul, (out, tp)) if sliced else out

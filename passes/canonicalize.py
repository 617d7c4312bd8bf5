"""Canonicalize: one form of the traced graph, whichever tracer produced it.

``torch.fx.symbolic_trace`` and ``torch.export`` trace the same training forward into different
graphs: export adds checks of the example inputs and records the capture's device (meta) as a
constant. :func:`canonicalize` is the first entry of ``autoshard.passes.PASSES``; capture runs it
(``passes.canonical``) right after tracing, before it annotates anything, so that the cost model,
the planner and every later pass read the same kind of graph and none of them cleans up after a
tracer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from autoshard.ir import Mask, ops
from autoshard.passes._graph import upstream
from autoshard.passes.moe_forms import batched_experts, expert_loops
from autoshard.runtime import moe

GUARDS = "_guards_fn"  # torch.export's submodule that checks the inputs against its shape guards


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata  # export checks dtypes at run time; a no-op here


def canonicalize(gm: fx.GraphModule, inputs: tuple | None = None, values: Values | None = None) -> fx.GraphModule:
    """Bring a freshly traced ``gm`` into canonical form, in place, and return it. (Long only for
    its docstring: the contract below, one item per rewrite; the body calls one function each.)

    Requires: ``gm`` is a traced training forward (``autoshard.capture.trace``) with at least one
    placeholder, the model inputs first among them; ``inputs`` are the example inputs it was
    traced with (their shapes are the sizes the program runs at). Nothing is read from
    ``node.meta``.

    Guarantees:

    - no ``_guards_fn`` call or submodule: torch.export's check of the inputs' shapes against the
      guards it derived (the emitted program's inputs differ from the example's, by design);
    - no ``_assert_tensor_metadata`` node: export's checks that a tensor has the dtype and the
      device (meta) it had while tracing;
    - no ``torch.device("meta")`` among any node's arguments: a factory call or ``.to`` that
      export recorded with the capture's device reads the device of the first model input
      instead, from one ``getattr(input, "device")`` node after the placeholders, so the graph
      runs wherever its inputs are;
    - with ``inputs``: no copy of a model input to the dtype, layout and device it already has
      (``input_ids.to(device)``): its readers read the input (:func:`input_copies`), so the loss
      reads the model's input whatever copies the model makes of it;
    - with ``inputs``: every ``scaled_dot_product_attention`` whose mask tensor is causal at the
      inputs' sizes is ``is_causal=True`` without the mask, and the nodes that only built the
      mask are gone (:func:`causal_masks`); a mask that is not causal stays, and the attention
      node's ``meta["mask"]`` (an ``ir.Mask``) says what it is: its kind, a phrase for the passes'
      refusals, a sliding window's width; the softmax of written-out attention whose scores are
      masked or biased by anything but a causal mask (ALiBi, a mask read from a buffer) says so too,
      and its ``masked_fill(scores, m, -inf)`` whose ``m`` hides exactly the later positions,
      however built, is ``meta["causal"]`` (:func:`_score_masks`); with ``values``, a buffer the
      model built on meta counts by its recorded value in these checks (nanoGPT's
      ``bias[:, :, :T, :T] == 0`` over a buffer of ``tril(ones)``);
    - every ``scaled_dot_product_attention`` whose keys and values are repeated to the query
      heads by views (transformers' ``repeat_kv``: unsqueeze, expand, reshape) reads them
      unrepeated with ``enable_gqa=True`` (:func:`grouped_keys`), so the cost model, context
      parallelism and tensor parallelism see the model's own key/value heads;
    - every product of an activation by a transposed 2-D parameter (``x @ w.T``, Falcon's
      ``FalconLinear``) is one ``linear(x, w)`` (:func:`weight_products`), the form tensor
      parallelism splits;
    - every RMS norm written out op by op is one ``rms_norm(x, [d], weight, eps)`` node
      (:func:`rms_norms`), but for one over a projection's output features;
    - every loop over expert modules (an ``nn.ModuleList`` of identical MLPs, each expert taking
      the rows ``where(choices == e)`` or a one-hot mask's slice selects and adding its result
      back by ``index_put`` / ``index_add``) is the grouped form: the routed rows sorted by
      expert, each projection one ``rt.moe_grouped_mm`` by the ``torch.stack`` of the experts'
      own parameters, one ``index_add`` back (``moe_forms.expert_loops``), so the cost model and
      expert parallelism see grouped experts;
    - every set of expert products by per-token gathered weights (``bmm(W[ids], h.unsqueeze(-1))``,
      transformers' ``batched_mm``) is grouped GEMMs by the stacked parameters over the routed
      slots sorted by expert, what they compute row by row kept in that order and sorted back where
      it leaves (``moe_forms.batched_experts``);
    - every grouped GEMM over rows grouped by expert (``torch._grouped_mm``, transformers'
      ``grouped_mm_fallback`` custom op) is one ``rt.moe_grouped_mm(rows, weights, offs)`` node
      (:func:`grouped_gemms`): the program then needs no library's custom op, and runs
      ``torch._grouped_mm`` where it has a kernel, a loop over experts elsewhere;
    - every ``histc`` of integers (expert ids) counts them as floats (:func:`float_histograms`):
      the same counts, on every device (CPU has no integer ``histc``; a model that picked the
      integer form for the device it was traced on, as transformers' grouped experts do for
      anything but CPU, would not run on CPU);
    - every tensor assembled in place from pieces that tile one of its dimensions
      (``buf = x.new_empty(...)``, then ``buf[..., a:b].copy_(piece)``) is one ``cat`` of the
      pieces (:func:`assembled_cats`);
    - every other node, its arguments and its ``meta`` are as traced (a graph already canonical,
      as ``symbolic_trace`` of a model without device constants gives, is left unchanged).
    """
    changed = _tracer_checks(gm)
    changed |= _inputs_device(gm.graph)
    if inputs is not None:
        changed |= input_copies(gm, inputs)
        changed |= causal_masks(gm, inputs, values)
    changed |= grouped_keys(gm)
    changed |= weight_products(gm)
    changed |= rms_norms(gm)
    changed |= assembled_cats(gm)
    changed |= expert_loops(gm)
    changed |= batched_experts(gm)
    changed |= grouped_gemms(gm)
    changed |= float_histograms(gm)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def canonicalize_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """:func:`canonicalize` as the first entry of ``autoshard.passes.PASSES``: the example inputs
    come from the context (``RewriteContext.inputs``), the meta buffers' values from ``ctx.values``."""
    return canonicalize(gm, ctx.inputs, ctx.values)


def _is_tracer_check(node: fx.Node) -> bool:
    return (node.op == "call_module" and node.target == GUARDS) or (
        node.op == "call_function" and getattr(node.target, "overloadpacket", None) is _ASSERT_METADATA
    )


def _tracer_checks(gm: fx.GraphModule) -> bool:
    """Remove export's input guards and metadata asserts (unused nodes); whether any was found."""
    changed = False
    for node in list(gm.graph.nodes):
        if not node.users and _is_tracer_check(node):
            gm.graph.erase_node(node)
            changed = True
    if hasattr(gm, GUARDS) and not any(n.op == "call_module" and n.target == GUARDS for n in gm.graph.nodes):
        gm.delete_submodule(GUARDS)
    return changed


def no_tracer_residue(gm: fx.GraphModule, ctx) -> str | None:
    """The canonical form's check: no tracer's input check and no capture-device constant left."""
    for node in gm.graph.nodes:
        if _is_tracer_check(node):
            return f"{node.name} is a tracer's check of the example inputs"
        if any(_is_meta(a) for a in (*node.args, *node.kwargs.values())):
            return f"{node.name} names the capture's meta device"
    return None


def _is_meta(x) -> bool:
    return isinstance(x, torch.device) and x.type == "meta"


def _inputs_device(graph: fx.Graph) -> bool:
    """Replace the meta-device constants by the first input's device; whether any was found."""
    device = None
    for node in list(graph.nodes):
        if not (any(_is_meta(a) for a in node.args) or any(_is_meta(v) for v in node.kwargs.values())):
            continue
        if device is None:
            placeholders = [p for p in graph.nodes if p.op == "placeholder"]
            with graph.inserting_after(placeholders[-1]):
                device = graph.call_function(getattr, (placeholders[0], "device"))
        node.args = tuple(device if _is_meta(a) else a for a in node.args)
        node.kwargs = {k: device if _is_meta(v) else v for k, v in node.kwargs.items()}
    return device is not None


# ---------------------------------------------------------------------------------------------
# Causal masks: a mask tensor computed from positions alone, evaluated at the traced sizes

MASK_LIMIT = 1 << 28  # bytes of the largest tensor a mask check may build (a boolean mask: batch 2 at 11K tokens)

# ops that read only a placeholder's shape, device or dtype, never its values
_SHAPE_READS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}
_SHAPE_ATTRS = ("device", "shape", "dtype", "ndim")
_SHAPE_METHODS = ("size", "dim")


def causal_masks(gm: fx.GraphModule, inputs: tuple, values: Values | None = None) -> bool:
    """Make every ``scaled_dot_product_attention`` whose mask is causal at the sizes of
    ``inputs`` plain causal attention (``is_causal=True``, no mask), erasing what built the mask;
    record on the others (``meta["mask"]``) why their mask is not. Whether any changed.

    A mask counts as causal only when its value is known from the sizes alone: the nodes that
    compute it read the inputs' shapes and device, constants and buffers with values, never an
    input's values or a parameter. It is evaluated on CPU at exactly the traced sizes (those the
    program runs at), so a sliding window wider than the sequence is causal here and is not at
    a longer one, which would be a different capture. ``values``: a meta buffer's value by name
    (its recorded initialisation replayed), or None where it has none.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sizes = {p: tuple(t.shape) for p, t in zip(placeholders, inputs)}
    verdicts: dict[fx.Node, Mask | None] = {}
    changed = False
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or _signature(node) != "sdpa":
            continue
        args = _sdpa_args(node)
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or args["is_causal"] is True:
            continue
        if mask not in verdicts:
            verdicts[mask] = mask_verdict(gm, mask, sizes, values=values)
        if verdicts[mask] is not None:
            node.meta["mask"] = verdicts[mask]
            continue
        given = {name: a for (name, _), a in zip(ops.SIGNATURES["sdpa"][3:], node.args[3:])} | dict(node.kwargs)
        rest = {k: v for k, v in given.items() if k not in ("attn_mask", "is_causal")}
        node.args = (args["query"], args["key"], args["value"])
        node.kwargs = {**rest, "is_causal": True}
        changed = True
    if changed:
        erase_unused(graph, [m for m, why in verdicts.items() if why is None])
    _score_masks(gm, sizes, values)
    return changed


_SOFTMAXES = ("softmax", "_softmax")
_SCORE_STEPS = 16  # ops between a softmax and the product of its scores: scale, casts, views, masks


def _score_masks(gm: fx.GraphModule, sizes: dict[fx.Node, tuple], values: Values | None = None) -> None:
    """On the softmax of written-out attention whose scores are masked or biased by anything but
    a causal mask (Bloom's ALiBi, added by ``baddbmm``; a mask read from a buffer without values),
    ``meta["mask"]``: what that is, the first found from the softmax back. A ``masked_fill`` of
    ``-inf`` on those scores whose mask is causal says so: ``meta["causal"]``, which the
    flash-attention pass reads instead of matching how the mask was written."""
    verdicts: dict[tuple[fx.Node, bool], Mask | None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or _op(node) not in _SOFTMAXES:
            continue
        for at, *term in _on_scores(node):
            term = tuple(term)
            if term not in verdicts:
                verdicts[term] = mask_verdict(gm, term[0], sizes, term[1], values)
            if verdicts[term] is not None:
                node.meta["mask"] = verdicts[term]
                break
            if _op(at) == "masked_fill" and at.args[2] == float("-inf"):
                at.meta["causal"] = True


def _on_scores(softmax: fx.Node) -> list[tuple[fx.Node, fx.Node, bool]]:
    """The masks and biases on the scores a softmax normalises, back to their product, each as
    ``(the op applying it, it, whether it marks the hidden positions)``: ``add``'s other operand
    and ``baddbmm``'s input (False), ``masked_fill``'s mask (True)."""
    terms, x = [], softmax.args[0]
    for _ in range(_SCORE_STEPS):
        if not isinstance(x, fx.Node) or not x.args:
            break
        row = ops.rule(_op(x))  # before capture's annotations: by the op's name
        if _op(x) == "baddbmm":
            terms.append((x, x.args[0], False))
        if row is None or row.flops == "matmul":
            break
        if _op(x) in ("add", "sub", "masked_fill") and len(x.args) > 1:
            terms.append((x, x.args[1], _op(x) == "masked_fill"))
        x = x.args[0]
    return [t for t in terms if isinstance(t[1], fx.Node)]


def _signature(node: fx.Node) -> str | None:
    row = ops.rule(ops.op_name(node))
    return row.signature if row is not None else None


def _sdpa_args(node: fx.Node) -> dict:
    layout = ops.SIGNATURES["sdpa"]
    args = {name: node.args[i] if i < len(node.args) else default for i, (name, default) in enumerate(layout)}
    args.update(node.kwargs)
    return args


def erase_unused(graph: fx.Graph, roots: list) -> None:
    """Erase the nodes among ``roots`` and, transitively, the computations they leave without
    users; inputs and reads of parameters and buffers stay (a persistent buffer is part of the
    model's state, read or not)."""
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n.users or n.op not in ("call_function", "call_method") or getattr(n, "_erased", False):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        stack.extend(inputs)


def mask_verdict(
    gm: fx.GraphModule, mask: fx.Node, sizes: dict[fx.Node, tuple], hides: bool = False, values: Values | None = None
) -> Mask | None:
    """None when ``mask`` is causal at ``sizes`` (placeholder -> traced shape); else what it is:
    its kind (``ir.MASK_KINDS``) and a phrase for a refusal ("sliding-window attention (window 4096)").
    ``hides``: a boolean mask is True where positions are hidden (``masked_fill``'s), not seen.
    ``values``: a meta buffer's value by name, where its recorded initialisation gives one.

    Where the mask at the traced sizes is too large to build (a long context), it is judged at
    shorter sequences instead (:func:`_shorter`): long enough that every integer the mask's
    computation uses (a window, a chunk size) shows its effect, and at two lengths that differ,
    so that a pattern at one length alone does not pass."""
    closure = upstream(mask)
    why = _not_from_positions(gm, closure, values)
    if why is not None:
        return why
    order = [n for n in gm.graph.nodes if n in closure]
    try:
        try:
            _evaluate(gm, order, sizes, torch.device("meta"))  # sizes only: refuses what is too large first
        except _TooLarge:
            return _judged_shorter(gm, order, sizes, hides, values)
        value = _evaluate(gm, order, sizes, torch.device("cpu"), values)
    except _TooLarge as e:
        return Mask("other", f"a mask tensor too large to check at the traced sizes ({e})")
    except Exception as e:  # an op that cannot run on sizes alone
        return Mask("other", f"a mask tensor that cannot be evaluated from the sizes ({type(e).__name__})")
    return _causal_verdict(value, hides)


def _judged_shorter(
    gm: fx.GraphModule, order: list[fx.Node], sizes: dict[fx.Node, tuple], hides: bool, values: Values | None
) -> Mask | None:
    """The verdict on a mask too large at the traced sizes, from the two shorter lengths of
    :func:`_shorter`: causal when causal at both, else what it is at the first."""
    seq = max((s[-1] for s in sizes.values() if s), default=0)
    for length in _shorter(order, seq):
        short = {p: tuple(length if d == seq else d for d in shape) for p, shape in sizes.items()}
        verdict = _causal_verdict(_evaluate(gm, order, short, torch.device("cpu"), values), hides)
        if verdict is not None:
            return verdict
    return None


def _shorter(order: list[fx.Node], seq: int) -> tuple[int, int]:
    """Two sequence lengths under ``seq`` at which a mask made by ``order`` shows what it is at
    ``seq``: above twice the largest integer below ``seq`` its ops use (a sliding window of 4096
    is seen as one at 8194 tokens), and 37 apart (an odd step: a pattern of one length fails
    the other). Raises ``_TooLarge`` where those lengths are as long as the traced one."""
    scales = [
        a
        for n in order
        for a in (*n.args, *n.kwargs.values())
        if isinstance(a, int) and not isinstance(a, bool) and 1 < abs(a) < seq
    ]
    first = max(64, 2 * max((abs(a) for a in scales), default=0) + 2)
    if first + 37 >= seq:
        raise _TooLarge(f"its integers need {first} tokens of the {seq} traced")
    return first, first + 37


def _reads_shape_only(user: fx.Node, placeholder: fx.Node) -> bool:
    if user.op == "call_function" and user.target in _SHAPE_READS:
        return True
    if user.op == "call_function" and user.target is getattr:
        return user.args[1] in _SHAPE_ATTRS
    return user.op == "call_method" and user.target in _SHAPE_METHODS and user.args[0] is placeholder


def _not_from_positions(gm: fx.GraphModule, closure: set[fx.Node], values: Values | None = None) -> Mask | None:
    """What the mask is when its value is not a function of sizes and constants, or None if it is."""
    params = {name for name, _ in gm.named_parameters()}
    for n in closure:
        if n.op == "placeholder":
            if any(not _reads_shape_only(u, n) for u in n.users if u in closure):
                return _from_input(n, closure)
        elif n.op == "get_attr":
            if n.target in params:
                return Mask("other", f"a mask computed from the parameter '{n.target}'")
            value = operator.attrgetter(n.target)(gm)
            if isinstance(value, torch.Tensor) and value.is_meta and _buffer(values, n.target, value) is None:
                return Mask(
                    "buffer",
                    f"a mask read from the buffer '{n.target}' (no values on the meta device: not known causal)",
                )
        elif n.op == "call_module":
            return Mask("other", f"a mask computed by the module '{n.target}'")
    return None


_EQUALS = ("eq", "__eq__")


def _from_input(placeholder: fx.Node, closure: set[fx.Node]) -> Mask:
    """A mask read from an input's values: a document mask where it compares the input with
    itself (``ids[:, :, None] == ids[:, None, :]``: positions of one document), padding else."""
    for n in closure:
        operands = [a for a in n.args if isinstance(a, fx.Node)]
        if _op(n) in _EQUALS and len(operands) == 2 and all(placeholder in upstream(a) for a in operands):
            return Mask("document", f"document masking (a mask comparing the input '{placeholder.target}' with itself)")
    return Mask("padding", f"a mask computed from the input '{placeholder.target}' (padding or document masking)")


class _TooLarge(Exception):
    pass


# a buffer's value on CPU, by its name in the graph, where the model's recorded initialisation
# gives one without randomness (capture's ``Init`` replayed); None where it does not
Values = Callable[[str], "torch.Tensor | None"]


def _buffer(values: Values | None, name: str, meta: torch.Tensor) -> torch.Tensor | None:
    """The value of the meta buffer ``name`` from ``values``, if small enough to check."""
    if values is None or meta.numel() * meta.element_size() > MASK_LIMIT:
        return None
    return values(name)


def _evaluate(gm: fx.GraphModule, order: list[fx.Node], sizes: dict, device: torch.device, values=None) -> object:
    """The value of the last node of ``order`` (a closure in graph order), run with placeholders
    as empty tensors of their traced sizes on meta and every device argument read as ``device``;
    every tensor made is checked against ``MASK_LIMIT``, and dropped once nothing needs it."""
    on = lambda a: device if isinstance(a, torch.device) else a
    members = set(order)
    pending = {n: sum(u in members for u in n.users) for n in order}
    env: dict[fx.Node, object] = {}
    for n in order:
        if n.op == "placeholder":
            env[n] = torch.empty(sizes[n], device="meta")
            continue
        if n.op == "get_attr":
            value = operator.attrgetter(n.target)(gm)
            if isinstance(value, torch.Tensor) and value.is_meta and device.type != "meta":
                value = _buffer(values, n.target, value)
            env[n] = value.to(device)
            continue
        args = fx.map_arg(n.args, lambda a: env[a])
        kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
        args = tuple(on(a) for a in args)
        kwargs = {k: on(v) for k, v in kwargs.items()}
        fn = n.target
        if n.op == "call_method":
            fn, args = getattr(args[0], n.target), args[1:]
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.untyped_storage().nbytes() > MASK_LIMIT:
            raise _TooLarge(f"{out.untyped_storage().nbytes() >> 20} MiB")
        env[n] = on(out)
        for a in n.all_input_nodes:
            pending[a] -= 1
            if not pending[a]:
                del env[a]
    return env[order[-1]]


def _causal_verdict(value, hides: bool = False) -> Mask | None:
    """None when ``value`` (a boolean mask, True where attending, or an additive one, 0 where
    attending and the dtype's lowest value or -inf elsewhere) is causal over its last two dims."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.is_meta:
        return Mask("other", "a mask that is not a tensor of positions")
    for d in range(value.dim() - 2):  # a broadcast (stride-0) dimension holds one value
        if value.stride(d) == 0:
            value = value.narrow(d, 0, 1)
    if value.dtype == torch.bool:
        allowed = ~value if hides else value
    elif value.dtype.is_floating_point:
        allowed = value == 0
        if not (allowed | (value <= torch.finfo(value.dtype).min)).all():
            return _bias_verdict(value)
    else:
        return Mask("other", f"a mask of dtype {value.dtype}")
    q, k = allowed.shape[-2:]
    if q != k:
        return Mask("other", f"a mask of {q} queries by {k} keys")
    causal = torch.ones(q, k, dtype=torch.bool).tril()
    if torch.equal(allowed, causal.expand_as(allowed)):
        return None
    if (allowed & ~causal).any():
        return Mask("not_causal", "a mask that lets positions attend to later ones (not causal)")
    window = int(allowed.sum(-1).max())
    if not window:
        return Mask("other", "a mask that hides every key")
    band = causal & ~torch.ones(q, k, dtype=torch.bool).tril(-window)
    if torch.equal(allowed, band.expand_as(allowed)):
        return Mask("sliding_window", f"sliding-window attention (window {window})", window)
    return Mask("other", "a mask that hides earlier positions (document masking or padding)")


def _bias_verdict(value: torch.Tensor) -> Mask:
    """An additive bias computed from positions: ALiBi where it grows along the keys by one step
    per row (a slope per head)."""
    step = value.diff(dim=-1)
    if value.size(-1) > 2 and torch.isfinite(value).all() and torch.allclose(step, step[..., :1].expand_as(step)):
        return Mask("positional_bias", "ALiBi (an additive bias of a slope per head times the key position)")
    return Mask("positional_bias", "an additive attention bias computed from positions")


# ---------------------------------------------------------------------------------------------
# Grouped-query attention: keys repeated by views become enable_gqa


def grouped_keys(gm: fx.GraphModule) -> bool:
    """Make every ``scaled_dot_product_attention`` whose key and value are both repeated per
    head by views (``x[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)``) read
    ``x`` with ``enable_gqa=True``: the same attention (query head ``i`` reads key head
    ``i // rep`` either way), without the copies. Needs the traced values (torch.export's
    ``meta["val"]``); whether any changed."""
    graph, changed, repeats = gm.graph, False, []
    for node in list(graph.nodes):
        if node.op != "call_function" or _signature(node) != "sdpa":
            continue
        args = _sdpa_args(node)
        key, value = _unrepeated(args["key"]), _unrepeated(args["value"])
        if key is None or value is None or args.get("enable_gqa"):
            continue
        repeats += [args["key"], args["value"]]
        node.args = tuple({1: key, 2: value}.get(i, a) for i, a in enumerate(node.args))
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        changed = True
    erase_unused(graph, repeats)
    return changed


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _unrepeated(node) -> fx.Node | None:
    """For ``reshape(expand(unsqueeze(x, 2), (b, kv, rep, s, d)), (b, kv * rep, s, d))`` (whole
    slices allowed between them): ``x``, of shape (b, kv, s, d); else None."""
    if ops.op_name(node) not in ("reshape", "view", "_unsafe_view") or not node.args:
        return None
    expand = node.args[0]
    out, wide = _shape(node), _shape(expand)
    if ops.op_name(expand) != "expand" or out is None or wide is None or len(wide) != 5 or len(out) != 4:
        return None
    x = _whole_slices(expand.args[0])
    if ops.op_name(x) != "unsqueeze" or tuple(x.args[1:]) != (2,):
        return None
    x = _whole_slices(x.args[0])
    b, kv, rep, s, d = wide
    if _shape(x) != (b, kv, s, d) or out != (b, kv * rep, s, d):
        return None
    return x


def _whole_slices(node):
    """``node`` past slices that keep the whole dimension (``x[:, :]``, as export writes them)."""
    while ops.op_name(node) == "slice" and tuple(node.args[2:4]) in ((), (0,), (0, _END)) and len(node.args) < 5:
        node = node.args[0]
    return node


_END = 9223372036854775807  # the end export writes for an open slice


# ---------------------------------------------------------------------------------------------
# Products by a transposed parameter become linear

_TRANSPOSES = {"t", "numpy_T", "transpose", "permute"}


def weight_products(gm: fx.GraphModule) -> bool:
    """Make every ``matmul(x, w.T)`` of a 2-D parameter ``w`` transposed by a node nothing else
    reads one ``linear(x, w)``: the same product, in the form the analysis and the passes read
    as a linear layer. Whether any changed."""
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or ops.op_name(node) != "matmul" or len(node.args) != 2 or node.kwargs:
            continue
        x, wt = node.args
        if not _transposed_parameter(gm, wt):
            continue
        aten = isinstance(node.target, torch._ops.OpOverload)
        with graph.inserting_before(node):
            linear = graph.call_function(
                torch.ops.aten.linear.default if aten else torch.nn.functional.linear, (x, wt.args[0])
            )
        linear.meta = dict(node.meta)
        node.replace_all_uses_with(linear)
        erase_unused(graph, [node])
        changed = True
    return changed


def _transposed_parameter(gm: fx.GraphModule, node) -> bool:
    """``w.T`` (``t``, ``numpy_T``, ``transpose(w, 0, 1)``, ``permute(w, [1, 0])``) of a 2-D
    parameter ``w``, read by one node."""
    if not isinstance(node, fx.Node) or ops.op_name(node) not in _TRANSPOSES or len(node.users) != 1:
        return False
    w = node.args[0] if node.args else None
    if not isinstance(w, fx.Node) or w.op != "get_attr":
        return False
    owner, _, leaf = w.target.rpartition(".")
    value = getattr(gm.get_submodule(owner), leaf, None)
    if not isinstance(value, torch.nn.Parameter) or value.dim() != 2:
        return False
    rest = [d % 2 if isinstance(d, int) else d for d in node.args[1:]]
    return rest in ([], [0, 1], [1, 0], [[1, 0]], [(1, 0)])


# ---------------------------------------------------------------------------------------------
# RMS norms written out op by op become one rms_norm

_RMS_NORM = torch.ops.aten.rms_norm.default


def rms_norms(gm: fx.GraphModule) -> bool:
    """Replace every RMS norm written out op by op (transformers' ``RMSNorm``:
    ``x * rsqrt(mean(x**2, -1, keepdim=True) + eps)``, then a multiply by a weight) by one
    ``rms_norm(x, [d], weight, eps)`` node, which computes the same values: the cost model then
    prices one norm that saves its input, as it does for a model that calls ``F.rms_norm``, and
    the program runs the fused op. Found from the ops alone (:func:`_written_rms_norm`), whatever
    the module is called; needs the traced values (torch.export's ``meta["val"]``). The fused
    node takes the meta of the last node it replaces (its value, module and source line).

    A norm over a projection's output features (``rms_norm(q_proj(x))``, OLMo2's q/k norm over
    all heads) stays written out: tensor parallelism may split those features column-wise, and
    normalises them as a partial-sum mean only in the written-out form. A norm per head (over a
    view of the projection, Qwen3's q/k norm) is fused. Whether any changed."""
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):
            continue
        found = _written_rms_norm(node)
        if found is None:
            continue
        x, d, weight, eps, tail = found
        with graph.inserting_before(tail):
            fused = graph.call_function(_RMS_NORM, (x, [d], weight, eps))
        fused.meta = dict(tail.meta)
        tail.replace_all_uses_with(fused)
        erase_unused(graph, [tail])
        changed = True
    return changed


def _written_rms_norm(stat: fx.Node) -> tuple | None:
    """For ``stat = mean(x**2, -1, keepdim=True)`` (``x * x`` too) starting
    ``x * rsqrt(stat + eps)`` (or ``x / sqrt(stat + eps)``), then, in any order, casts that keep
    the traced dtype and one multiply by a tensor ``weight`` of shape ``(d,)`` (any expression:
    Gemma's ``1 + w``): ``(x, d, weight or None, eps, the last of those nodes)``. None when
    any step differs, a step's result is read elsewhere, ``x`` is (past casts) a projection's
    output, or ``rms_norm`` would give another dtype than the written-out ops."""
    if _op(stat) != "mean" or stat.kwargs.get("dtype") is not None or not _keepdim(stat):
        return None
    square = stat.args[0]
    x = _squared(square)
    shape = _shape(x)
    if x is None or not shape or len(square.users) != 1 or len(stat.users) != 1:
        return None
    d = shape[-1]
    if not isinstance(d, int) or list(stat.args[1]) not in ([-1], [len(shape) - 1]):
        return None
    add, eps = _only_user(stat), None
    if _op(add) == "add" and len(add.args) == 2 and isinstance(add.args[1 - add.args.index(stat)], float):
        eps = add.args[1 - add.args.index(stat)]
    root = _only_user(add) if eps is not None else None
    tail = _normalised(x, root)
    if tail is None or _projection(x):
        return None
    if _upcast(x) and set(x.users) <= {square, tail}:
        # the norm's own upcast (transformers' ``hidden_states.to(torch.float32)``): the fused norm
        # computes in fp32 and returns its input's dtype, so it reads (and keeps) the tensor before it
        x = x.args[0]
    weight = None
    while len(tail.users) == 1:
        user = _only_user(tail)
        if _op(user) in ops.CASTS and user.args[0] is tail and _dtype(user) == _dtype(tail):
            tail = user
        elif weight is None and _op(user) == "mul" and len(user.args) == 2 and tail in user.args:
            other = user.args[1 - user.args.index(tail)]
            if not isinstance(other, fx.Node) or other is tail or _shape(other) != (d,):
                break
            weight, tail = other, user
        else:
            break
    return (x, d, weight, eps, tail) if _same_result(x, d, weight, eps, tail) else None


def _op(node) -> str:
    """The op's normalised name; "" for a module call (the fusion reads functions only)."""
    return ops.op_name(node) if isinstance(node, fx.Node) and node.op != "call_module" else ""


def _keepdim(node: fx.Node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _squared(square) -> fx.Node | None:
    """``x`` for ``x ** 2`` or ``x * x``."""
    if _op(square) == "pow" and len(square.args) == 2 and square.args[1] == 2:
        return square.args[0] if isinstance(square.args[0], fx.Node) else None
    if _op(square) == "mul" and len(square.args) == 2 and square.args[0] is square.args[1]:
        return square.args[0]
    return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _normalised(x: fx.Node, root) -> fx.Node | None:
    """``x * rsqrt(...)`` for ``root = rsqrt(...)``, ``x / sqrt(...)`` for ``root = sqrt(...)``."""
    product = _only_user(root) if isinstance(root, fx.Node) else None
    if product is None or len(product.args) != 2 or product.kwargs:
        return None
    if _op(root) == "rsqrt" and _op(product) == "mul" and set(product.args) == {x, root}:
        return product
    if _op(root) == "sqrt" and _op(product) == "div" and tuple(product.args) == (x, root):
        return product
    return None


def _upcast(x: fx.Node) -> bool:
    """``x`` is a cast of a floating tensor to fp32 (``to``/``_to_copy`` as export records it)."""
    if ops.cast_target(x) is not torch.float32 or not isinstance(x.args[0], fx.Node):
        return False
    before = _dtype(x.args[0])
    return before is not None and before.is_floating_point


def _projection(x: fx.Node) -> bool:
    """``x`` is, past casts, a matmul by a parameter (a projection's output features)."""
    while _op(x) in ops.CASTS and isinstance(x.args[0], fx.Node):
        x = x.args[0]
    row = ops.rule(_op(x))
    if row is None or row.flops != "matmul":
        return False
    return any(a.op == "get_attr" for a in x.all_input_nodes)


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _same_result(x: fx.Node, d: int, weight, eps, tail: fx.Node) -> bool:
    """``rms_norm`` of tensors of the traced dtypes has the dtype the written-out ops traced, and
    the shape of ``x`` (no broadcast widened it)."""
    if _shape(tail) != _shape(x) or _dtype(x) is None or _dtype(tail) is None:
        return False
    if weight is not None and _dtype(weight) is None:
        return False
    w = None if weight is None else torch.empty(d, dtype=_dtype(weight), device="meta")
    got = _RMS_NORM(torch.empty(1, d, dtype=_dtype(x), device="meta"), [d], w, eps)
    return got.dtype == _dtype(tail)


# ---------------------------------------------------------------------------------------------
# Tensors assembled in place from pieces become one cat

_CAT = torch.ops.aten.cat.default


def assembled_cats(gm: fx.GraphModule) -> bool:
    """Replace every tensor assembled in place, ``buf = x.new_empty(shape)`` then
    ``buf[..., a:b].copy_(piece)`` for slices that tile one dimension of ``buf`` (transformers'
    DeepseekV3 writes its keys so: the per-head part and the rope part shared by every head), by
    ``cat(pieces, dim)``: the same values as data flow, which the sharding analysis and the passes
    follow (a write into a slice of another tensor they cannot). Needs the traced values
    (torch.export's ``meta["val"]``); a buffer read before it is complete, a piece of another
    shape or dtype than its slice (``copy_`` broadcasts and casts), or slices that overlap or
    leave a gap stay as written. Whether any changed."""
    graph, changed = gm.graph, False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for buf in list(graph.nodes):
        found = _assembled(buf, order) if _op(buf) == "new_empty" else None
        if found is None:
            continue
        dim, pieces, slices = found
        copies = [next(iter(s.users)) for s in slices]
        with graph.inserting_after(max(copies, key=order.__getitem__)):
            cat = graph.call_function(_CAT, (pieces, dim))
        cat.meta = dict(buf.meta)
        for reader in [u for u in buf.users if u not in slices]:
            reader.replace_input_with(buf, cat)
        for node in (*copies, *slices, buf):
            graph.erase_node(node)
        changed = True
    return changed


def _assembled(buf: fx.Node, order: dict[fx.Node, int]) -> tuple[int, list[fx.Node], list[fx.Node]] | None:
    """For a ``new_empty`` buffer filled by ``copy_`` into slices along one dimension that tile
    it, each slice written once and read by nothing else, every other reader after the last
    copy: ``(dim, the pieces in order, their slices)``; else None."""
    shape = _shape(buf)
    slices = [u for u in buf.users if _op(u) == "slice" and u.args[0] is buf]
    if shape is None or not slices:
        return None
    spans, last = [], -1
    for s in slices:
        copy = _only_user(s)
        dim, start, end, step = (*s.args[1:], *(0, 0, _END, 1)[len(s.args) - 1 :])
        dim = dim + len(shape) if dim < 0 else dim
        if _op(copy) != "copy_" or copy.args[0] is not s or copy.users or step != 1 or s.kwargs:
            return None
        piece = copy.args[1]
        if _shape(piece) != _shape(s) or _dtype(piece) != _dtype(buf) or not isinstance(shape[dim], int):
            return None
        spans.append((start, min(_END if end is None else end, shape[dim]), dim, piece, s))
        last = max(last, order[copy])
    spans.sort(key=lambda x: x[0])
    dims = {x[2] for x in spans}
    bounds = [0, *(x[1] for x in spans)]
    if len(dims) != 1 or [x[0] for x in spans] != bounds[:-1] or bounds[-1] != shape[dims.pop()]:
        return None
    if any(order[u] < last for u in buf.users if u not in slices):
        return None
    return spans[0][2], [x[3] for x in spans], [x[4] for x in spans]


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs become the runtime's


def grouped_gemms(gm: fx.GraphModule) -> bool:
    """Replace every grouped GEMM ``f(rows, weights, offs)`` (rows grouped by expert, ``weights``
    ``[E, K, N]``, ``offs`` cumulative rows per expert) that takes no bias and no output dtype by
    ``autoshard.runtime.moe.grouped_mm``: the same product. Whether any changed."""

    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is moe.grouped_mm:
            continue
        if ops.op_name(node) not in ops.GROUPED_MATMULS:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        offs = node.kwargs.get("offs", args[2])
        extra = [a for a in args[3:] if a is not None]
        extra += [v for k, v in node.kwargs.items() if k != "offs" and v is not None]
        if not isinstance(offs, fx.Node) or extra:
            continue
        node.target, node.args, node.kwargs = moe.grouped_mm, (args[0], args[1], offs), {}
        changed = True
    return changed


_TO = ("to", "_to_copy")
_SAME = {"non_blocking", "copy", "memory_format", "dtype", "layout", "device"}


def input_copies(gm: fx.GraphModule, inputs: tuple) -> bool:
    """Drop each ``to`` / ``_to_copy`` of a model input that asks for what the input already is
    (its dtype, strided, the device of a model input, no forced copy); whether any was found."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = False
    for node, example in zip(placeholders, inputs):
        if not isinstance(example, torch.Tensor):
            continue
        for user in list(node.users):
            if (
                user.op != "call_module"
                and ops.op_name(user) in _TO
                and user.args[0] is node
                and _asks_nothing(user, example, placeholders)
            ):
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
                found = True
    return found


def _asks_nothing(to: fx.Node, example: torch.Tensor, placeholders: list[fx.Node]) -> bool:
    """``to``'s arguments after the tensor name only what ``example`` already is."""

    def same(value) -> bool:
        if isinstance(value, fx.Node):  # the device of a model input (all inputs share one)
            return value.op == "call_function" and value.target is getattr and value.args[0] in placeholders
        if isinstance(value, torch.dtype):
            return value == example.dtype
        if isinstance(value, torch.device):
            return value == example.device
        if isinstance(value, torch.layout):
            return value == torch.strided
        if isinstance(value, torch.memory_format):
            return value == torch.preserve_format
        return value is None or value is False

    kwargs_ok = all(k == "non_blocking" or (k in _SAME and same(v)) for k, v in to.kwargs.items())
    return kwargs_ok and all(same(a) for a in to.args[1:])


def float_histograms(gm: fx.GraphModule) -> bool:
    """``histc(ids)`` of an integer tensor -> ``histc(ids.float())`` (exact below 2**24). Needs the
    traced values (``meta["val"]``). Whether any changed."""
    changed = False
    for node in list(gm.graph.nodes):
        if _op(node) != "histc" or not isinstance(node.args[0], fx.Node):
            continue
        dtype = _dtype(node.args[0])
        if dtype is None or dtype.is_floating_point:
            continue
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],), {"dtype": torch.float32})
        val = node.args[0].meta["val"]
        cast.meta = {**node.args[0].meta, "val": val.to(torch.float32)}
        node.args = (cast, *node.args[1:])
        changed = True
    return changed

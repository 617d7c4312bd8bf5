"""Selective activation checkpointing for one layer: ``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``, saving the outputs of the op kinds the plan keeps and
recomputing the rest in backward.

The plan chooses per saved-tensor kind; at run time the policy sees ATen ops, so each kind maps
to the ops that produce it (a matmul in the attention score path counts as ``linear_output`` here,
which the cost model counts under ``attention``: the policy can keep a little more than planned,
never less). With every kind recomputed this is full recomputation of the layer from its input.

FP8 matmuls (``runtime.fp8``) are two ops to the policy: the input's quantisation and the forward
GEMM. The GEMM's output is a ``linear_output`` (``experts`` for the experts' products) like any
matmul's. A kept kind in ``fp8_saved`` is kept as its FP8 copy instead: its ops are recomputed
and the quantisations the stage file marks ``keep_fp8=True`` (of that kind's tensors, which only
FP8 matmuls read) are kept, 1 byte and a 4-byte scale per 128 elements instead of 2 or 4 bytes;
so are the inputs of the experts' FP8 GEMMs where the experts are kept (``passes.fp8``), which
keeps the recomputation from dispatching the tokens again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoshard.ir.categories import RUNTIME_OPS
from autoshard.runtime import attention, fp8, norms, phase  # noqa: F401 (attention and norms register their torch ops)

aten = torch.ops.aten


def _ops(*names: str) -> set:
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


def _resolve(qualified: str):
    namespace, name = qualified.split("::")
    return getattr(getattr(torch.ops, namespace), name, None)


# category -> the ops that make it (the table is the categories', read by the cost model too)
KINDS = {kind: {op for op in map(_resolve, names) if op is not None} for kind, names in RUNTIME_OPS.items()}


_QUANTIZE = torch.ops.autoshard.fp8_quantize_rows
_FP8_MM = torch.ops.autoshard.fp8_mm


def _keeps(kept: frozenset, saved: frozenset, func, args) -> bool:
    packet = getattr(func, "overloadpacket", func)
    if packet is _QUANTIZE:
        return bool(args[1])
    if packet is _FP8_MM:
        return ("experts" if args[7] else "linear_output") in kept
    return packet in saved


def _policy(kept: frozenset, saved: frozenset, ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if _keeps(kept, saved, func, args) else CheckpointPolicy.PREFER_RECOMPUTE


# matmul outputs the policy caches that autograd may not keep: an output projection's (read by a
# residual add, a dropout or a TP reduction, none of which keeps its input), attention scores
# (read by a scale and a mask before the softmax)
_GEMMS = _ops("mm", "addmm", "bmm", "_grouped_mm") | {_FP8_MM}
# the experts' GEMMs (bf16; an FP8 one keeps its inputs' FP8 copies, ``keep_fp8``)
_EXPERTS_GEMMS = _ops("_grouped_mm")
# the ops a kind names (their outputs the policy keeps or not by the plan's kinds)
_KINDED = set().union(*KINDS.values()) | {_QUANTIZE, _FP8_MM}
# ops whose backward keeps none of their tensor inputs (views alias them; the rest keep a mask,
# their output, or nothing): reading a tensor, they do not make autograd keep it
_KEEP_NO_INPUT = _ops(  # fmt: skip
    "add",
    "sub",
    "neg",
    "native_dropout",
    "clone",
    "_to_copy",
    "copy_",
    "cat",
    "stack",
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "unbind",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "alias",
    "detach",
    "index_select",  # these three keep only their indices (and the input's sizes)
    "gather",
    "embedding",
    "_softmax",
    "_log_softmax",
    "masked_fill",
    "contiguous",
    "sum",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty_strided",
    "bernoulli_",
    "fill_",
    "zero_",
)
# products and quotients keep an operand for the other's gradient, if that one needs one (a
# scale by a number or by a dropout's noise keeps nothing of the scaled; torch's CPU dropout is
# such a product)
_PRODUCTS = _ops("mul", "div")
# the norms, and the ops whose kept outputs count as ``norm_input`` only where a norm reads them
# (the plan's category is the saver's: a rotary embedding's sum that attention keeps is an
# ``activation``)
_NORMS = KINDS["norm_output"]
_SUMS = KINDS["norm_input"]
_COLLECTIVES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")
# ops the recomputation may skip where nothing it needs reads what they make (``_Region.release``):
# pure functions of their inputs (no randomness, no writes to their inputs) returning fresh
# tensors; the skipped call returns an uninitialised tensor of the same layout
_SKIPPABLE = (
    _GEMMS
    | _ops(  # fmt: skip
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "_to_copy",
        "clone",
        "cat",
        "stack",
        "gelu",
        "silu",
        "relu",
        "sigmoid",
        "tanh",
        "sum",
        "mean",
        "pow",
        "rsqrt",
        "where",
        "_softmax",
        "_log_softmax",
        "index_select",  # the dispatch's reordering of the rows it received
        "gather",
    )
    | {_QUANTIZE, torch.ops.autoshard.fp8_dequantize_rows}
)
# reshapes that return a new tensor over the same storage (no view to autograd): as a view, one
# nothing needs makes nothing it reads needed (the experts' dispatched tokens are reshaped so:
# counted as needed, their dispatch ran again in every recomputation)
_RESHAPES = _ops("_unsafe_view")
# the outputs that read their inputs' values, of ops with others: a dropout's mask (output 1)
# is random, only its output 0 reads the input; a ``*_like`` factory reads its input's layout
_LAYOUT_ONLY = ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like")
_SHAPED_AFTER = _ops(*_LAYOUT_ONLY, "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")
_VALUE_OUTPUTS = {aten.native_dropout: (0,)} | dict.fromkeys(_SHAPED_AFTER, ())
# ops that make a tensor from no values (the buffer a collective fills, an SP gather's ``empty``)
_FACTORIES = _SHAPED_AFTER | _ops(
    "empty", "empty_strided", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "scalar_tensor"
)


def _saved_for_weights(packet, args) -> set[int]:
    """Storages of the operands a matmul saves only for a weight's gradient: each operand whose
    partner is a weight (a parameter, through views and casts) is kept for that weight's
    gradient alone."""
    operands = _operands(packet, args)
    if len(operands) != 2:
        return set()
    out = set()
    for a, other in ((operands[0], operands[1]), (operands[1], operands[0])):
        if _from_weight(other) and (st := _storage(a)) is not None:
            out.add(id(st))
    return out


def _operands(packet, args) -> tuple:
    """A matmul's two operands (none for any other op)."""
    if packet not in _GEMMS:
        return ()
    operands = tuple(args[1:3] if packet is aten.addmm else args[:2])
    return operands if len(operands) == 2 and all(isinstance(a, torch.Tensor) for a in operands) else ()


def _is_view(func) -> bool:
    return getattr(func, "is_view", False) or getattr(func, "overloadpacket", func) in _RESHAPES


def _from_weight(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter, or made of one alone by views and casts."""
    if not t.requires_grad:
        return False
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return isinstance(t, nn.Parameter)
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(getattr(fn, "variable", None), nn.Parameter)
        following = [f for f, _ in fn.next_functions if f is not None]
        if len(following) != 1:
            return False
        fn = following[0]
    return False


def _leaves(x, out: list | None = None) -> list:
    """The leaves of an op's arguments or outputs, as ``tree_leaves`` gives them for what ops
    take and return (tuples, lists, dicts, return-type tuples; ``torch.Size`` a leaf), without
    the general pytree's per-node lookups: the policy walks every op of every checkpointed layer
    twice (forward and replay), where that host time shows."""
    out = [] if out is None else out
    if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
        for y in x:
            _leaves(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _leaves(y, out)
    else:
        out.append(x)
    return out


def _storage(t):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _Region:
    """One forward of a checkpointed layer under the policy, and what it found: the storages that
    ops keeping their inputs read (``read``). ``release`` then lets go of each cached matmul
    output none of them read: autograd keeps nothing of it, so the plan counts nothing of it,
    and the recomputation makes it again where something it recomputes needs it; and of each
    cached sum no norm read (``norm_input`` is what a norm keeps: the rotary embedding's sums
    that attention keeps are ``activation`` to the plan). (torch's selective checkpoint caches
    every output its policy names, whether autograd keeps it or not: at GPT-3 175B, 111 GB of
    attention scores and output projections on one pipeline rank.)"""

    def __init__(self, kept: frozenset, saved: frozenset):
        self.kept, self.saved = kept, saved
        self.read: dict[int, weakref.ref] = {}  # id(storage) -> the storage, while it lives
        self.normed: dict[int, weakref.ref] = {}  # the same, of the storages a norm read
        self.cache = None  # the selective checkpoint's storage: op -> call index -> cached output
        self.units: list[tuple[torch.Tensor, bool]] = []  # ``unit`` and ``kept_whole`` outputs, in call order
        self.kept_inputs: list[torch.Tensor] = []  # GEMMs' inputs of kinds the plan keeps, made by ops of no kind
        self.unit_calls: dict[int, int] = {}  # the call standing for a ``kept_whole`` output -> its ``units`` index
        self.unit_inputs: dict[int, list[int]] = {}  # a ``unit``'s ``units`` index -> its inputs saved to be remade
        # the forward's op calls as a graph (what ``release`` finds the unneeded ones in): per
        # call [op, its index among that op's calls, (call, output) pairs it read, skippable,
        # a collective, the layout of its outputs]; None where torch does not show the policy
        # an op's output
        self.calls: list | None = []
        self._made: dict[int, tuple] = {}  # id(storage) -> (its weakref, the call, the output) that last made it
        self._counts: dict = defaultdict(int)
        self._packed: set[tuple[int, int]] = set()  # (call, output) pairs autograd saved
        self._packed_for_weights: set[tuple[int, int]] = set()  # those saved only for a weight's gradient
        self._pending: list[tuple] = []  # (call, output) pairs and storages autograd saved since the last op began
        self.skipped_in_input_pass: set[int] = set()  # the ``collective``s a split backward's input pass skips
        self.collectives: list = []  # per ``collective`` of the forward, the call that wrote its output
        self.skipped: set[int] = set()  # the ``collective``s the recomputation skips
        self.replayed = 0  # ``collective``s the recomputation has met
        self.units_met = 0  # ``unit``s the recomputation has met
        self.kept_any = False  # whether the policy kept any op's output

    def policy(self, ctx, func, *args, **kwargs):
        packet = getattr(func, "overloadpacket", func)
        namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
        if packet in _PRODUCTS:  # each operand kept for the other's gradient: a dropout's noise needs none
            grads = [isinstance(a, torch.Tensor) and a.requires_grad for a in args[:2]]
            read = [a for a, other in zip(args[:2], grads[::-1]) if other]
        elif packet in _KEEP_NO_INPUT or namespace in _COLLECTIVES:
            read = []
        else:
            read = _leaves((args, kwargs))
        for t in read:
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None and id(st) not in self.read:
                self._note(self.read, st)
        if packet in _NORMS and isinstance(args[0], torch.Tensor) and (st := _storage(args[0])) is not None:
            self._note(self.normed, st)
        self._sort_saves(packet, args)
        keep = _keeps(self.kept, self.saved, func, args)
        self.kept_any |= keep
        if packet in _GEMMS and self.calls is not None:
            self._note_kept_inputs(packet, args)
        if self.calls is not None:
            if hasattr(ctx, "op_output"):
                self._record(func, packet, namespace in _COLLECTIVES, (args, kwargs), ctx.op_output)
            else:  # torch before the policy saw outputs: recompute as torch does
                self.calls = None
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    # -- the forward as a graph of op calls ----------------------------------------------------

    def _maker(self, t) -> tuple[int, int] | None:
        st = _storage(t)
        hit = self._made.get(id(st)) if st is not None else None
        return hit[1:] if hit is not None and hit[0]() is st else None

    def _record(self, func, packet, collective: bool, inputs, out) -> None:
        idx = self._counts[func]
        self._counts[func] += 1
        tensors = [t for t in _leaves(inputs) if isinstance(t, torch.Tensor)]
        reads = [m for t in tensors if (m := self._maker(t)) is not None]
        read_ids = {id(_storage(t)) for t in tensors}
        leaves = _leaves(out)
        outs = [t for t in leaves if isinstance(t, torch.Tensor)]
        fresh = bool(outs) and len(outs) == len(leaves)
        call = len(self.calls)
        for i, t in enumerate(outs):
            st = _storage(t)
            if st is None:
                fresh = False
                continue
            key = id(st)
            if key in read_ids or t.storage_offset() or self._maker(t) is not None:
                fresh = False  # a view, or a write into a tensor made before
            ref = weakref.ref(
                st, lambda r, key=key: self._made.pop(key) if self._made.get(key, (None,))[0] is r else None
            )
            self._made[key] = (ref, call, i)
        # counts and indices are read on the host, some out of the policy's sight (``tolist``):
        # only floating-point outputs are skipped
        made = fresh and all(t.is_floating_point() for t in outs)  # new floating-point tensors
        skippable = made and packet in _SKIPPABLE
        layout = torch.utils._pytree.tree_map(_Unmade.of, out) if made else None
        self.calls.append((func, idx, reads, skippable, collective, layout))

    @contextlib.contextmanager
    def noting_saves(self):
        """Note which op calls' outputs autograd saves while the layer's forward runs (through
        the checkpoint's own pack hook: what it saves is what the recomputation must remake)."""
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None or self.calls is None:
            self.calls = None
            yield
            return
        pack, unpack = hooks

        def noting(t):
            if (m := self._maker(t)) is not None:
                self._pending.append((m, id(_storage(t))))
            return pack(t)

        with torch.autograd.graph.saved_tensors_hooks(noting, unpack):
            yield

    def made_whole(self, out: torch.Tensor) -> None:
        """Take ``out``, the output of a ``kept_whole`` the forward just ran out of the policy's
        sight, into the op graph as one call reading nothing: the recomputation needs it where
        autograd saved it or a remade op reads it."""
        self.units.append((out.detach(), out.requires_grad))
        if self.calls is None or (st := _storage(out)) is None:
            return
        call, key = len(self.calls), id(st)
        ref = weakref.ref(st, lambda r: self._made.pop(key) if self._made.get(key, (None,))[0] is r else None)
        self._made[key] = (ref, call, 0)
        self.calls.append((kept_whole, len(self.unit_calls), [], False, False, None))
        self.unit_calls[call] = len(self.units) - 1

    def kind_of(self, t: torch.Tensor) -> str:
        """The plan's kind of ``t``, by the op that made it (through views), as the cost model
        classes a tensor an attention keeps: a matmul's output is a ``linear_output``, a norm's
        a ``norm_output``, any other op's (the rotary embedding's sums) an ``activation``; one
        from outside the layer is its input, which the checkpoint keeps."""
        m = self._origin(t) if self.calls is not None else None
        if m is None or _is_view(func := self.calls[m[0]][0]):
            return "layer_input"
        packet = getattr(func, "overloadpacket", func)
        kinds = ("linear_output", "norm_output", "attention", "experts")
        return next((k for k in kinds if packet in KINDS[k]), "activation")

    def _sort_saves(self, packet, args) -> None:
        """File the saves autograd made since the last op began (``_pending``): the previous
        op's of its outputs, then this op's of its inputs (autograd saves an op's inputs before
        it runs, its outputs after). A matmul's input saved only for a weight's gradient (its
        partner is a weight) goes to ``_packed_for_weights``."""
        pending, self._pending = self._pending, []
        own = []
        weights = _saved_for_weights(packet, args)
        if weights:
            operands = {id(_storage(a)) for a in _operands(packet, args)}
            while pending and pending[-1][1] in operands and len(own) < len(operands):
                own.append(pending.pop())
        self._packed.update(m for m, _ in pending)
        for m, st in own:
            (self._packed_for_weights if st in weights else self._packed).add(m)

    def need(self, tensors) -> None:
        """The recomputation must remake ``tensors`` (read by what the policy does not see)."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and (m := self._maker(t)) is not None:
                self._packed.add(m)

    def _skip_unneeded(self, recompute) -> None:
        """Give each op call the recomputation would run for nothing an uninitialised output
        instead, and mark each ``collective`` it would run for nothing as skipped: nothing
        autograd saved is made from what they make, nor anything that runs. torch's selective
        checkpoint replays the layer's forward up to the last op whose output autograd saved,
        running every op it did not cache on the way, needed or not (GPT-3 175B: the second MLP
        product before its dropout, 11% more FLOPs than planned). The decision reads only the
        op graph, the same on every rank of a group, so every rank skips the same collectives."""
        calls, self.calls = self.calls, None
        if calls is None:
            return
        self._sort_saves(None, ())  # the last op's saves of its outputs
        needed = self._sweep(calls, self._packed | self._packed_for_weights, recompute, edit=True)
        # a ``collective`` writes its output: the call that made it is the collective itself (a
        # functional one) or the buffer it writes into (an EP all-to-all's ``empty``)
        self.skipped = {n for n, m in enumerate(self.collectives) if m is not None and not needed[m[0]]}
        # a split backward's input pass computes no weight gradient: what is saved only for one
        # (a sequence-parallel gathered input of the column products) it need not gather again
        inputs = self._sweep(calls, self._packed, recompute, edit=False) if self._packed_for_weights else needed
        self.skipped_in_input_pass = {n for n, m in enumerate(self.collectives) if m is not None and not inputs[m[0]]}
        for c, n in self.unit_calls.items():  # a kept exchange's output nothing remade reads: let go
            if not needed[c]:
                value, grad = self.units[n]
                self.units[n] = (_Unmade.of(value), grad)
        self._made.clear()
        self._packed.clear()
        self._packed_for_weights.clear()

    def _sweep(self, calls, packed, recompute, edit: bool) -> list[set[int]]:
        """Per op call, its outputs the recomputation needs to remake ``packed`` (newest first);
        ``edit``: give each skippable call nothing needs its uninitialised output in the cache."""
        needed: list[set[int]] = [set() for _ in calls]
        for c, i in packed:
            needed[c].add(i)
        # the buffers ``collective``s write into: such a collective is needed where what it wrote
        # is (the readers of the buffer come after it, so the sweep has found them), and then so
        # is what it sends (a combine's expert outputs: skipped, the replay sent uninitialised rows)
        buffers = {m for m in self.collectives if m is not None}
        for c in range(len(calls) - 1, -1, -1):
            func, idx, reads, skippable, collective, layout = calls[c]
            entry = self.cache.get(func, {}).get(idx)
            if entry is not recompute:
                continue  # cached (or not a call the replay makes): reads nothing
            packet = getattr(func, "overloadpacket", func)
            writes = collective and any(m in buffers and m[1] in needed[m[0]] for m in reads)
            if not needed[c] and not writes and (skippable or collective or _is_view(func)):
                if skippable and edit:
                    if not isinstance(self.cache[func], _Calls):
                        self.cache[func] = _Calls(self.cache[func])
                    self.cache[func][idx] = layout
                continue
            values = _VALUE_OUTPUTS.get(packet)
            if values is not None and not needed[c].intersection(values):
                continue  # it runs, but what is needed of it does not read its inputs' values
            for m in reads:
                needed[m[0]].add(m[1])
        return needed

    def release(self) -> None:
        recompute = getattr(torch.utils.checkpoint, "_RECOMPUTE", None)
        if recompute is None or self.cache is None:  # a torch whose cache differs: keep what it cached
            return
        for key, calls in self.cache.items():
            packet = getattr(key, "overloadpacket", key)
            readers = self.read if packet in _GEMMS else self.normed if packet in _SUMS else None
            if readers is None:
                continue
            for idx, entry in calls.items():
                if entry is recompute:
                    continue
                tensors = [w.val for w in tree_leaves(entry) if isinstance(getattr(w, "val", None), torch.Tensor)]
                if tensors and not any(_found(readers, t) for t in tensors):
                    calls[idx] = recompute
        self._keep_inputs(recompute)
        self._skip_unneeded(recompute)

    def _note_kept_inputs(self, packet, args) -> None:
        """Note the inputs of a GEMM the plan keeps that an op of no kind made: the cost model
        counts what a GEMM keeps of such an op as an ``activation`` (the SwiGLU product before
        the down projection, the copy of the attention's output before the output projection),
        as ``experts`` inside the experts (the product the experts' second GEMM reads)."""
        kind = "experts" if packet in _EXPERTS_GEMMS else "activation"
        if kind not in self.kept:
            return
        for a in args[:3]:
            if not isinstance(a, torch.Tensor) or not a.is_floating_point():
                continue
            base = a._base if a._base is not None else a
            if (m := self._origin(base)) is None or m[1] != 0:  # the op that made the storage
                continue
            func, _, reads, _, collective, layout = self.calls[m[0]]
            packet = getattr(func, "overloadpacket", func)
            if (
                not collective
                and packet not in _KINDED
                and packet not in _FACTORIES
                and isinstance(layout, _Unmade)  # one new tensor, over ``base``'s storage
                and base.storage_offset() == 0
            ):
                self.kept_inputs.append(base)

    def _origin(self, t):
        """The (call, output) that made ``t``'s storage, through the views of it (the view
        reading no recorded tensor where there is none)."""
        m = self._maker(t)
        while m is not None and _is_view(self.calls[m[0]][0]) and self.calls[m[0]][2]:
            m = self.calls[m[0]][2][0]
        return m

    def _keep_inputs(self, recompute) -> None:
        """Cache the inputs ``_note_kept_inputs`` found: the policy names kinds by op, and these
        ops (a ``mul``, a ``clone``) name none, so the recomputation made them again and the
        layer held none of them (LLaMA-3 405B keeping activations: 0.76 of the planned
        activation bytes; Mixtral 8x22B keeping the experts: 0.87)."""
        wrapper = getattr(torch.utils.checkpoint, "_VersionWrapper", None)
        inputs, self.kept_inputs = self.kept_inputs, []
        if wrapper is None or self.calls is None:
            return
        for a in inputs:
            if (m := self._origin(a)) is not None and m[1] == 0:
                func, idx, *_, layout = self.calls[m[0]]
                if self.cache.get(func, {}).get(idx) is recompute:  # the op's output, as it made it
                    self.cache[func][idx] = wrapper(a.detach().as_strided(layout.size, layout.stride, 0))

    @staticmethod
    def _note(table: dict, st) -> None:
        key = id(st)
        table[key] = weakref.ref(st, lambda _: table.pop(key, None))


class _Calls(dict):
    """One op's entries in the selective checkpoint's cache, where a skipped call's stays for
    every recomputation: torch marks an entry used once it is read, which is right for a cached
    output autograd then holds, but would make a region with skipped calls recomputable only
    once, where a split backward recomputes a layer in its input pass and again in its weight
    pass (``_EveryCall``: there every entry stays)."""

    keep_all = False

    def __setitem__(self, idx, value):
        if value is getattr(torch.utils.checkpoint, "_CONSUMED", None):
            entry = self.get(idx)
            if any(isinstance(x, _Unmade) for x in tree_leaves(entry)):
                return
            if self.keep_all:
                # torch hands the cached tensor itself to the recomputation, where autograd gives
                # it the recomputation's history: kept as it is, it would keep that whole graph
                # (every tensor the recomputation saved) to the layer's weight pass. A new alias
                # without history stays instead.
                super().__setitem__(idx, torch.utils._pytree.tree_map(_fresh, entry))
                return
        super().__setitem__(idx, value)


def _fresh(w):
    """A selective-cache entry's wrapper around a new alias of its tensor, without history."""
    wrapper = getattr(torch.utils.checkpoint, "_VersionWrapper", None)
    if wrapper is None or not isinstance(w, wrapper) or not isinstance(w.val, torch.Tensor):
        return w
    detach = getattr(torch.utils.checkpoint, "_detach_helper", torch.Tensor.detach)
    return wrapper(detach(w.val))


class _EveryCall(_Calls):
    """The entries of a layer under a split-backward schedule: its input pass and its weight pass
    are two backward calls, each recomputing the layer (torch's checkpoint remakes a region per
    call), and each takes the cached outputs. torch's selective checkpoint allows one backward
    per region: a second would find them used. The cache holds them until the layer's graph
    goes, after its weight pass, as the plan counts a split backward's micro-batch in flight."""

    keep_all = True


class _Unmade:
    """A skipped call's output in the selective checkpoint's cache: an uninitialised tensor of
    the forward's layout."""

    __slots__ = ("size", "stride", "dtype", "device")

    @staticmethod
    def of(x):
        if not isinstance(x, torch.Tensor):
            return x
        out = _Unmade()
        out.size, out.stride, out.dtype, out.device = tuple(x.shape), x.stride(), x.dtype, x.device
        return out

    def get_val(self, allow_cache_entry_mutation=False):
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


def read_by_keeper(*tensors: torch.Tensor) -> None:
    """Count ``tensors`` as read by an op that keeps its inputs, in a selectively checkpointed
    layer's forward: the local K/V a context-parallel all-gather reads for the attention, which
    keeps what it gathers. A cached matmul output among them stays cached (the cost model counts
    the local K/V the attention keeps), and the recomputation gathers it again without running
    the matmul again."""
    mode = _get_current_dispatch_mode()
    region = getattr(mode, "autoshard_region", None)
    if isinstance(region, _Region) and isinstance(mode, torch.utils.checkpoint._CachingTorchDispatchMode):
        for t in tensors:
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
                region._note(region.read, st)


def collective(run, out: torch.Tensor) -> None:
    """``run()``, a collective writing ``out``, except in a selective checkpoint's recomputation
    where nothing it remakes needs ``out`` (``_Region._skip_unneeded``: the decision reads the
    layer's op graph, so every rank of the group skips the same calls)."""
    mode = _get_current_dispatch_mode()
    region = getattr(mode, "autoshard_region", None)
    if not isinstance(region, _Region):
        run()
    elif isinstance(mode, torch.utils.checkpoint._CachingTorchDispatchMode):  # the layer's forward
        run()
        region.collectives.append(region._maker(out) if region.calls is not None else None)
    else:  # its recomputation
        n, region.replayed = region.replayed, region.replayed + 1
        if n not in (region.skipped_in_input_pass if phase.in_input_pass() else region.skipped):
            run()


def _found(table: dict, t) -> bool:
    st = _storage(t)
    ref = table.get(id(st)) if st is not None else None
    return ref is not None and ref() is st


def unit(fn, *args):
    """``fn(*args)`` (an autograd Function that communicates inside: ring attention, whose kind
    is ``attention``) as one piece under a selectively checkpointed layer. torch's selective
    checkpoint would see the ops inside it, cache those of kept kinds (every hop's partial output
    and its fp32 merges: 136 GB at LLaMA-3 70B and 131K tokens on one rank) and, whatever it
    keeps, run its sends again in the recomputation. Here the cache does not see inside; where
    the plan keeps attention, the Function keeps what it saves for its own backward and the
    recomputation takes its output as the forward made it, running nothing of it again; where
    the plan recomputes attention, the recomputation runs it whole. Outside a selective
    checkpoint (or under full recomputation), ``fn(*args)``."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    mode = _get_current_dispatch_mode()
    region = getattr(mode, "autoshard_region", None)  # the selective checkpoint's modes know their region
    if not isinstance(region, _Region):
        return fn(*args)
    keep = "attention" in region.kept
    if isinstance(mode, torch.utils.checkpoint._CachingTorchDispatchMode):  # the layer's forward
        if not keep:  # the recomputation runs it again, from its inputs
            region.need(args)
            with _pop_mode_temporarily():
                return fn(*args)
        saves = _UnitSaves(region, args)
        with _pop_mode_temporarily(), torch.autograd.graph.saved_tensors_hooks(saves.pack, saves.unpack):
            out = fn(*args)
        region.unit_inputs[len(region.units)] = saves.order
        region.units.append((out.detach(), out.requires_grad))
        return out
    if not keep:  # its recomputation
        with _pop_mode_temporarily():
            return fn(*args)
    n = region.units_met
    value, grad = region.units[n]
    region.units_met += 1
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # the recomputation's
    for i in region.unit_inputs.get(n, ()):  # remade: saved again, in the forward's order
        hooks[0](args[i])
    return value.detach().requires_grad_(grad)


class _UnitSaves:
    """What a kept ``unit``'s Function saves for its backward: each of its inputs of a kind the
    plan recomputes through the checkpoint (the recomputation remakes it, and the unit's
    recomputation saves it again), all else as itself. Ring attention keeps its query, key and
    value: under a plan that recomputes activations they are the rotary embedding's outputs,
    which the plan counts as recomputed (their projections run again); kept as themselves they
    were held (Mixtral 8x22B: 1.6 GB more activations than planned on a rank) and the
    projections' FLOPs planned for nothing."""

    def __init__(self, region: _Region, args):
        self.hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)  # the checkpoint's
        self.remade = {
            i: a
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and self.hooks is not None and region.kind_of(a) not in region.kept
        }
        self.order: list[int] = []

    def pack(self, t):
        for i, a in self.remade.items():
            if _same_tensor(t, a):
                self.order.append(i)
                return _Remade(self.hooks[0](t))
        return _alias(t)

    def unpack(self, packed):
        return self.hooks[1](packed.packed) if isinstance(packed, _Remade) else packed


class _Remade:
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        _storage(a) is not None
        and _storage(a) is _storage(b)
        and (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
    )


def kept_whole(kind: str, fn, *args) -> torch.Tensor:
    """``fn(*args)``, an exchange over a group whose output is a ``kind`` tensor to the plan (an
    expert-parallel dispatch's rows, a combine's: ``experts``), under a selectively checkpointed
    layer. Where the plan keeps ``kind``, the forward runs ``fn`` out of the policy's sight and
    the recomputation takes its output as the forward made it, running nothing of ``fn`` again:
    torch's policy sees the ops inside (an all-to-all into an empty buffer, a reordering) and
    caches none of them, so its recomputation sent the tokens again wherever anything read
    them (Mixtral 8x22B, whose routing weights scale the combined rows: twice the planned
    expert-parallel bytes, and the experts' second GEMM run again for the combine to send).
    The output is kept only where autograd saved it or a remade op reads it; otherwise the
    recomputation gets an uninitialised tensor of its layout. Where the plan recomputes
    ``kind``, or outside a selective checkpoint, ``fn`` runs in the policy's sight like any
    code (its exchanges skipped where nothing needs them)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    mode = _get_current_dispatch_mode()
    region = getattr(mode, "autoshard_region", None)
    if not isinstance(region, _Region) or kind not in region.kept:
        return fn(*args)
    if isinstance(mode, torch.utils.checkpoint._CachingTorchDispatchMode):  # the layer's forward
        with _pop_mode_temporarily(), torch.autograd.graph.saved_tensors_hooks(_alias, _same):
            out = fn(*args)
        region.made_whole(out)
        return out
    value, grad = region.units[region.units_met]  # its recomputation
    region.units_met += 1
    value = value.get_val() if isinstance(value, _Unmade) else value.detach()
    return value.requires_grad_(grad)


def _alias(t):
    return t.detach()  # kept as itself, a saved output would hold its own grad_fn (a cycle)


def _same(t):
    return t


class Checkpoint(nn.Module):
    """Run ``fn`` (a layer) under activation checkpointing, keeping the kinds not in ``recompute``
    (those in ``fp8_saved`` as their FP8 copies)."""

    def __init__(self, fn, recompute: list[str], fp8_saved: list[str] = ()):
        super().__init__()
        self.split_backward = False  # set for split-backward schedules (``runtime.program``)
        object.__setattr__(self, "fn", fn)  # not a child module: its parameters belong to the stage
        self.recompute = sorted(recompute)
        self.fp8_saved = sorted(k for k in fp8_saved if k not in self.recompute)
        kept = frozenset(k for k in KINDS if k not in self.recompute and k not in self.fp8_saved)
        saved = frozenset().union(*(KINDS[k] for k in kept))
        self._keeps = bool(saved) or bool(self.fp8_saved)
        self._kept, self._saved = kept, saved
        self._region: _Region | None = None
        self._first: _Region | None = None  # the region of the first forward (``_recomputes_all``)
        self._plain = False  # a layer found to keep nothing: plain checkpointing

    def _context(self):
        region = _Region(self._kept, self._saved)
        caching, cached = create_selective_checkpoint_contexts(region.policy)
        region.cache = getattr(caching, "storage", None)
        if self.split_backward and isinstance(region.cache, defaultdict):
            region.cache.default_factory = _EveryCall
        caching.autoshard_region = cached.autoshard_region = region
        self._region = self._first = region
        return caching, cached

    def _run(self, *args):
        fp8.forget_inputs()  # the forward and its recomputation quantise the same inputs first
        region, self._region = self._region, None  # None in the recomputation: its forward made it
        if region is None:
            mode = _get_current_dispatch_mode()
            if isinstance(getattr(mode, "autoshard_region", None), _Region):
                # each recomputation (a split backward makes two) meets the collectives and units from the first
                mode.autoshard_region.replayed = mode.autoshard_region.units_met = 0
            return self.fn(*args)
        with region.noting_saves():
            out = self.fn(*args)
        region.release()
        return out

    def forward(self, *args):
        if not self._keeps or self._plain:  # full recomputation: plain checkpointing (no selective cache)
            return checkpoint(self._run, *args, use_reentrant=False)
        out = checkpoint(self._run, *args, use_reentrant=False, context_fn=self._context)
        self._plain = self._recomputes_all(self._first)
        return out

    def _recomputes_all(self, region) -> bool:
        """Whether the forward just run under the policy kept nothing of its own: no op output
        (the kinds the plan keeps did not occur in the layer, as a dense layer has no experts),
        no collective's (which the recomputation would otherwise run again), no ``unit``. Such
        a layer runs under plain checkpointing from then on: the same recomputation, without the
        policy's host time per op. (A split backward's two passes keep the policy's cache.)"""
        self._first = None
        if region is None or self.split_backward:
            return False
        return not (region.kept_any or region.collectives or region.units or region.kept_inputs)

    def extra_repr(self) -> str:
        return f"recompute={self.recompute}" + (f", fp8_saved={self.fp8_saved}" if self.fp8_saved else "")

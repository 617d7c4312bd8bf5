"""Analyze: per repeated layer kind (and for the embedding and output regions), FLOPs, bytes moved,
parameters, the tensors saved for backward and the communication volumes each parallel dimension
implies, all symbolic in batch ``b`` and sequence ``s``.

The result, ``ModelCost``, is what the planner searches over; it never looks at the graph again.

Saved tensors are counted once per storage (views share it) with the rules of ``ops.RULES`` and
grouped into *checkpoint categories*, the unit of selective recomputation:

``layer_input``   the tensor entering the layer (always kept: the checkpoint boundary)
``norm_input``    residual-stream tensors a norm keeps
``norm_output``   norm outputs (inputs of the following projections)
``linear_output`` projection outputs (Q/K/V, MLP up/gate) kept by what follows
``activation``    outputs of pointwise ops (activation functions, rotary, gating products)
``attention``     the attention core: scores, softmax, its dropout, or flash's output and LSE
``dropout_mask``  dropout masks outside attention
``experts``       tensors kept inside routed experts
``loss``          the loss's fp32 log-probabilities (output region)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import cached_property

import sympy
from torch import fx

from autoshard.capture import Captured
from autoshard.cost_models import sharding
from autoshard.cost_models.flops import ZERO_COST, NodeCost, elem_bytes, matmul_flops, node_cost
from autoshard.ir import B, S, ops
from autoshard.ir.categories import CHECKPOINT_CATEGORIES, saved_category
from autoshard.ir.fp8 import SAVED_BYTES as FP8_SAVED_BYTES

# the kinds a plan may recompute, plus the layer input (kept by any checkpoint) and the loss's
RECOMPUTABLE = CHECKPOINT_CATEGORIES
CATEGORIES = ("layer_input", *RECOMPUTABLE, "loss")


def _fn(expr: sympy.Expr):
    """Compile an expression in b and s to a plain Python function of (b, s)."""
    return sympy.lambdify(
        (B, S), expr, modules=[{"floor": lambda x: int(x // 1), "FloorDiv": lambda a, b: a // b}, "math"]
    )


@dataclass
class SavedTensor:
    """One storage autograd keeps for backward."""

    category: str
    elems: sympy.Expr
    fixed_bytes: int | None  # None: floating, at the compute dtype's size
    tp_sharded: bool
    per_token: bool  # has batch and sequence dims (sequence/context parallelism shards it)
    producer: str
    # the matmul kinds of its keepers when only weighted matmuls keep it (an FP8 matmul keeps
    # its input's FP8 copy instead), None when anything else keeps it too
    matmul_kinds: frozenset[str] | None = None

    def elem_bytes(self, float_bytes: int = 2) -> int:
        return self.fixed_bytes if self.fixed_bytes is not None else float_bytes

    def fp8_only(self, fp8) -> bool:
        """Only weighted matmuls of the ``fp8`` kinds keep it (they can keep its FP8 copy instead)."""
        return bool(self.matmul_kinds) and self.matmul_kinds <= set(fp8)

    def split(self, tp: int, sp: bool, fp8_copy: bool = False) -> int:
        """The ranks it is divided among: ``tp`` inside TP regions, and for a per-token tensor
        under sequence parallelism, except as an FP8 copy, which is of what the TP region reads
        (all-gathered)."""
        return tp if self.tp_sharded or (sp and self.per_token and not fp8_copy) else 1

    def bytes(self, b: float, s: float, float_bytes: int = 2) -> float:
        size = self.elem_bytes(float_bytes)
        return float(self.elems.subs({B: b, S: s})) * size if self.elems.free_symbols else float(self.elems) * size


@dataclass
class Collective:
    """Communication one forward pass of the block implies on one parallel dimension."""

    axis: str  # tp | ep
    kind: str  # all_reduce (TP without SP), all_to_all (EP: routed tokens), weights (EP: a stack's rows)
    elems: sympy.Expr
    backward: bool  # also once in backward
    source: str = ""  # an EP dispatch: the node whose tokens it sends (``BlockCost.replayed_exchanges``)


@dataclass(frozen=True)
class Gemm:
    """One weighted matrix product of a block, at full (unsharded) size."""

    m: sympy.Expr  # rows: tokens (or per-expert capacity)
    n: int  # output features
    k: int  # contraction
    batch: int  # stacked experts (1 for a plain linear)
    role: str  # TP role: column | row | vocab | replicated
    experts: bool
    count: int = 1  # experts the routing chooses among (1 for a dense product)
    kind: str = "mlp"  # autoshard.ir.MATMUL_KINDS: what the FP8 choice is made per
    heads: int = 0  # a key/value column's heads (0: not one): TP above them shares each head

    def out_split(self, tp: int) -> int:
        """The ways TP divides a column's output features: ``tp``, or its key/value heads where
        they are fewer (each rank computes one head, shared with tp/heads ranks)."""
        return min(tp, self.heads) if self.heads else tp

    def weight_split(self, tp: int) -> int:
        """The ways TP divides the weight one rank holds: 1 for key/value heads fewer than ``tp``,
        whose weight every rank keeps whole and cuts its head's rows out of in the graph."""
        if self.role not in ("column", "row", "vocab") or (self.heads and self.heads < tp):
            return 1
        return tp


@dataclass
class BlockCost:
    """Costs of one layer kind (``count`` copies) or of the pre/post region (count 1)."""

    name: str
    count: int
    layers: list[int]
    params: int
    params_tp: int  # parameters divided among TP ranks
    params_experts: int  # parameters of routed experts (divided among EP ranks)
    flops: sympy.Expr  # forward FLOPs
    flops_tp: sympy.Expr  # the part TP divides
    flops_experts: sympy.Expr  # the part inside routed experts
    flops_attention: sympy.Expr  # the attention core (quadratic in s)
    bytes_moved: sympy.Expr
    flops_by_class: dict[str, sympy.Expr]
    bytes_by_class: dict[str, sympy.Expr]
    saved: list[SavedTensor]
    collectives: list[Collective]
    boundary_elems: sympy.Expr  # elements of the block's output activation (pipeline p2p)
    gemms: list[Gemm] = field(default_factory=list)
    bytes_pointwise: sympy.Expr = sympy.Integer(0)  # HBM traffic of everything but weighted matmuls
    bytes_pointwise_tp: sympy.Expr = sympy.Integer(0)  # the part inside TP regions
    kv_elems: sympy.Expr = sympy.Integer(0)  # keys + values entering attention (context parallel traffic)
    flops_attention_whole: sympy.Expr = sympy.Integer(0)  # the attention core TP leaves whole on every rank
    # score elements (query x key pairs, after the causal mask) per FLOP of the fused attention
    # kernels (SDPA-like: their softmax runs inside the kernel, once per score): 1 / (2 (d + dv))
    scores_per_attention_flop: float = 0.0
    # outputs of the ops other than weighted matmuls that read a parameter and an activation (a
    # norm's scale, a learned bias or gate): their gradients are what a weight-gradient pass
    # reads (``LayerCosts.held_for_weights``)
    weighted_outputs: list[SavedTensor] = field(default_factory=list)
    # matmul-class forward FLOPs (what a FLOP counter counts: weighted GEMMs, attention's products,
    # any other matmul) as (attention core TP divides, the rest TP divides, the rest every TP rank
    # does whole, attention core every TP rank does whole)
    matmul: tuple = (sympy.Integer(0),) * 4
    traced_ops: int = 0  # the block's traced operations (call_function, call_method, call_module)
    # (what, dropped categories) -> the recomputation closure: sympy expressions and flags, no
    # functions, so that a frozen block pickles (``freeze``)
    _closure: dict = field(default_factory=dict, repr=False)
    _nodes: list | None = field(default_factory=list, repr=False)  # None: frozen (``freeze``)

    @cached_property
    def _compiled(self):
        return {
            "flops": _fn(self.flops),
            "flops_tp": _fn(self.flops_tp),
            "flops_experts": _fn(self.flops_experts),
            "flops_attention": _fn(self.flops_attention),
            "flops_attention_whole": _fn(self.flops_attention_whole),
            "bytes_moved": _fn(self.bytes_moved),
            "boundary": _fn(self.boundary_elems),
            "bytes_pointwise": _fn(self.bytes_pointwise),
            "bytes_pointwise_tp": _fn(self.bytes_pointwise_tp),
            "kv_elems": _fn(self.kv_elems),
            "matmul": [_fn(e) for e in self.matmul],
            "gemm_m": [_fn(g.m) for g in self.gemms],
            "collectives": [(c, _fn(c.elems)) for c in self.collectives],
            "saved": [(t, _fn(t.elems)) for t in self.saved],
        }

    def eval(self, what: str, b: float, s: float) -> float:
        return float(self._compiled[what](b, s))

    def saved_bytes(self, b: float, s: float, float_bytes: int = 2) -> dict[str, float]:
        """Bytes kept per category at micro-batch ``b`` and sequence ``s`` (no parallelism)."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for t, f in self._compiled["saved"]:
            out[t.category] += float(f(b, s)) * t.elem_bytes(float_bytes)
        return out

    def activation_bytes(
        self,
        b: float,
        s: float,
        *,
        tp: int = 1,
        sp: bool = False,
        recompute: frozenset[str] | set[str] = frozenset(),
        float_bytes: int = 2,
        fp8: tuple[str, ...] = (),
        fp8_saved: frozenset[str] | set[str] = frozenset(),
    ) -> float:
        """Bytes one copy of this block keeps for backward on one GPU.

        ``tp`` divides tensors inside TP regions; with ``sp`` the replicated per-token tensors are
        divided too (sequence parallelism). Categories in ``recompute`` are dropped and rebuilt in
        backward, except the layer input, which is the checkpoint. Without recomputation a tensor
        kept only by matmuls of the ``fp8`` kinds is kept as their FP8 copy (1 byte and a 4-byte
        scale per 128); under selective recomputation the categories in ``fp8_saved``
        (``ModelCost.fp8_saved``) are, and so are the kept experts' tensors that only FP8 experts'
        GEMMs read (their inputs: the dispatched rows and the activations' product, which the
        checkpoint does not cache; ``passes.fp8``), and the rest as they are.
        """
        total = 0.0
        for t, f in self._compiled["saved"]:
            if t.category in recompute and t.category != "layer_input":
                continue
            size, split = t.elem_bytes(float_bytes), t.split(tp, sp)
            if fp8 and t.category != "layer_input":
                if not recompute and t.fp8_only(fp8):
                    size = FP8_SAVED_BYTES
                elif t.category in fp8_saved or t.category == "experts" and t.fp8_only(fp8):
                    size, split = FP8_SAVED_BYTES, t.split(tp, sp, fp8_copy=True)
            total += float(f(b, s)) * size / split
        return total

    @cached_property
    def _recomputable(self) -> frozenset[str]:
        """The categories whose dropping decides what recomputation reruns: those the block keeps
        (but its input, the checkpoint). A category it does not keep drops nothing of it, so the
        closures below depend only on a recompute set's part in these."""
        return frozenset(t.category for t in self.saved) - {"layer_input"}

    @cached_property
    def _fns(self) -> dict:
        """The closures below compiled to functions of (b, s); never pickled (``freeze``)."""
        return {}

    def _dropped(self, recompute) -> frozenset[str]:
        return frozenset(recompute) & self._recomputable

    def _closed(self, what: str, dropped: frozenset[str], make):
        """The closure ``what`` of ``dropped``, made once (``make(dropped)``) and kept in
        ``_closure``, which ``freeze`` fills for every set and a frozen block only reads."""
        key = (what, dropped)
        if key not in self._closure:
            if self._nodes is None:
                raise KeyError(f"{self.name}: a frozen block lacks its {what} closure of {sorted(dropped)}")
            self._closure[key] = make(dropped)
        return self._closure[key]

    def recompute_flops(self, recompute: frozenset[str] | set[str]) -> sympy.Expr:
        """Forward FLOPs rerun in backward to rebuild the dropped categories."""
        return self._closed("flops", self._dropped(recompute), lambda d: _closure_flops(self, d))

    def recompute_fn(self, recompute):
        key = ("flops", self._dropped(recompute))
        if key not in self._fns:
            self._fns[key] = _fn(self.recompute_flops(recompute))
        return self._fns[key]

    def recompute_matmul_fns(self, recompute) -> list:
        """``matmul``'s four parts for what recomputation reruns, as functions of (b, s)."""
        key = ("matmul", self._dropped(recompute))
        if key not in self._fns:
            self._fns[key] = [_fn(e) for e in self._closed("matmul", key[1], self._rerun_matmul)]
        return self._fns[key]

    def replayed_exchanges(self, recompute) -> tuple[tuple[bool, bool], ...]:
        """Per expert-parallel collective of ``collectives``: whether the recomputation of
        ``recompute`` runs its dispatch again (a rerun op reads the tokens it sends, and nothing
        keeps them) and its combine (a rerun op outside the experts reads a rerun expert's
        output, which comes back by the combine). A checkpointed layer replays its forward's
        exchanges as it replays its ops: recomputing every kind of a MoE layer sends its tokens
        to the experts and back once more, half again the layer's expert-parallel bytes. The
        combine is decided per block (one routed MoE per layer).

        A stack's exchange into whole expert weights (kind ``weights``) runs again in every
        recomputation, whatever it drops: the experts' GEMMs save those weights for backward,
        the checkpoint keeps none of a region's saved tensors and its policy caches no exchange,
        so the weights are remade as the forward made them (under a kept ``experts`` kind too:
        measured, a loop of experts recomputing only ``norm_output`` sent 1.25 of the bytes
        planned before the model counted it). The layer then holds no whole weights from its
        forward to its backward, as ZeRO-3 holds no gathered parameters."""
        sent, combine = self._closed("exchanges", self._dropped(recompute), self._rerun_exchanges)
        recomputes = bool(frozenset(recompute) - {"layer_input"})
        ep = [c for c in self.collectives if c.axis == "ep"]
        return tuple((recomputes if c.kind == "weights" else again, combine) for c, again in zip(ep, sent))

    def _rerun_matmul(self, dropped: frozenset[str]) -> tuple[sympy.Expr, ...]:
        """``matmul``'s four parts over what recomputing ``dropped`` reruns."""
        return _matmul_parts(_rerun(self, dropped))

    def _rerun_exchanges(self, dropped: frozenset[str]) -> tuple[tuple[bool, ...], bool]:
        """(per expert-parallel collective, whether a rerun op is its source; whether a rerun op
        outside the experts reads a rerun expert's output) when ``dropped`` is recomputed."""
        rerun = _rerun(self, dropped) if dropped else set()
        names = {n.name for n in rerun}
        combine = any(
            n.meta.get("op_class") != "experts"
            and any(a in rerun and a.meta.get("op_class") == "experts" for a in n.all_input_nodes)
            for n in rerun
        )
        return tuple(c.source in names for c in self.collectives if c.axis == "ep"), combine

    def freeze(self) -> BlockCost:
        """This block without its graph: every closure the planner can ask for made
        (``_closure`` for each subset of ``_recomputable``), the nodes dropped. What a snapshot
        of the planner's input keeps (``ModelCost.freeze``)."""
        for dropped in category_subsets(sorted(self._recomputable)):
            self.recompute_flops(dropped)
            self._closed("matmul", dropped, self._rerun_matmul)
            self.replayed_exchanges(dropped)
        return replace(self, _closure=dict(self._closure), _nodes=None)

    def __getstate__(self) -> dict:
        """The fields and closures; the compiled functions (lambdas) are made again on use."""
        if self._nodes is not None:
            raise TypeError(f"{self.name}: freeze() a block before pickling it (its graph does not travel)")
        return {k: v for k, v in self.__dict__.items() if k not in ("_compiled", "_fns")}

    @property
    def categories(self) -> list[str]:
        present = {t.category for t in self.saved}
        return [c for c in RECOMPUTABLE if c in present]


@dataclass(frozen=True)
class CaptureFacts:
    """What the planner and the plan it writes read of a capture (``ModelCost.captured``), for a
    frozen cost with no graph or model (``ModelCost.freeze``)."""

    source: str | None  # where the model came from (its file), for errors
    parameters: int
    notes: tuple[str, ...]  # capture's assumptions, for the plan to state


@dataclass
class ModelCost:
    captured: Captured | CaptureFacts
    blocks: list[BlockCost]  # layer kinds, in order of first appearance
    pre: BlockCost
    post: BlockCost
    facts: dict = field(default_factory=dict)  # heads, kv_heads, experts, tp_dims, hidden, vocab, tied

    @property
    def params(self) -> int:
        return self.captured.parameters

    @property
    def num_layers(self) -> int:
        return sum(k.count for k in self.blocks)

    def all_blocks(self) -> list[BlockCost]:
        return [self.pre, *self.blocks, self.post]

    def flops_forward(self, b: float, s: float) -> float:
        return sum(blk.count * blk.eval("flops", b, s) for blk in self.all_blocks())

    def flops_per_token(self, s: float) -> dict[str, float]:
        """Model FLOPs per token at sequence ``s``: forward, and training (forward + 2x backward)."""
        fwd = self.flops_forward(1, s) / s
        return {"forward": fwd, "training": 3 * fwd}

    def fp8_saved(
        self, recompute, fp8: tuple[str, ...], *, tp: int = 1, sp: bool = False, float_bytes: int = 2
    ) -> frozenset[str]:
        """The kept categories a layer under selective recomputation keeps as their FP8 copies
        (``runtime.checkpoint``): those not recomputed (nor the layer input) every tensor of
        which, in every layer kind, only matmuls of the ``fp8`` kinds keep, and whose copies are
        smaller than the tensors. Under sequence parallelism a replicated per-token tensor's copy
        is of what the TP region reads, all-gathered: not smaller. Their producers are then
        rerun in backward (``recompute_flops`` of ``recompute | fp8_saved``)."""
        if not recompute or not fp8:
            return frozenset()
        present, ruled_out = set(), set()
        for blk in self.blocks:
            for t in blk.saved:
                present.add(t.category)
                copy = FP8_SAVED_BYTES / t.split(tp, sp, fp8_copy=True)
                if not t.fp8_only(fp8) or copy >= t.elem_bytes(float_bytes) / t.split(tp, sp):
                    ruled_out.add(t.category)
        return frozenset(present - ruled_out - set(recompute) - {"layer_input"})

    def freeze(self) -> ModelCost:
        """This cost without the graph and the model: each block's recomputation closures made for
        every set the planner can ask (``BlockCost.freeze``) and, of the capture, only what the
        planner reads (``CaptureFacts``). It plans as this one does, and pickles in a few kilobytes
        (Llama 3 405B: 3.4 kB gzipped) where the graph does not pickle at all (too deep to recurse
        along)."""
        cap = self.captured
        facts = CaptureFacts(cap.source, cap.parameters, tuple(cap.notes))
        return ModelCost(facts, [b.freeze() for b in self.blocks], self.pre.freeze(), self.post.freeze(), self.facts)

    def block_of_layer(self, layer: int) -> BlockCost:
        return next(b for b in self.blocks if layer in b.layers)


# ---------------------------------------------------------------------------------------------


def analyze(captured: Captured) -> ModelCost:
    gm = captured.graph_module
    sharding.annotate(gm)
    annotate_kinds(gm)
    templates = [_with_params(captured.layer_nodes[kind.template], gm) for kind in captured.kinds]
    pre_nodes, post_nodes = captured.region_nodes("pre"), captured.region_nodes("post")
    _annotate_costs([*templates, pre_nodes, post_nodes], gm, float_bytes=2)
    blocks = []
    for kind, nodes in zip(captured.kinds, templates):
        blocks.append(_block(f"layer kind {kind.id}", kind.count, kind.layers, nodes, gm))
    pre = _block("embedding", 1, [], pre_nodes, gm)
    # a parameter the embedding holds (a head tied to it) is counted there, not again in the head
    held = {id(p) for n in pre_nodes for _, p in _parameters_read(n, gm)}
    post = _block("output", 1, [], post_nodes, gm, counted=held)
    facts = _facts(gm, blocks, [pre, *blocks, post]) | {"tied": _tied(gm)}
    return ModelCost(captured, blocks, pre, post, facts)


def _annotate_costs(blocks: list[list[fx.Node]], gm: fx.GraphModule, float_bytes: int) -> None:
    """``node.meta["cost"]`` on the nodes of ``blocks``, the only ones analysis reads it on: a
    layer that is not its kind's template costs what the template does, so pricing the other
    layers' nodes (all but one layer in 126, for Llama 3 405B) would be work thrown away."""
    for nodes in blocks:
        for n in nodes:
            n.meta["cost"] = _node_cost(n, gm, float_bytes)


def _node_cost(n: fx.Node, gm: fx.GraphModule, float_bytes: int) -> NodeCost:
    """The op table's cost of ``n``, but experts whose stacked weights are gathered per routed
    token (``W[choices]``, then a batched product) priced as a grouped GEMM runs them, as the
    expert-parallel pass does: the gather copies nothing, the product reads each weight once."""
    if ops.expert_rows(n):
        return ZERO_COST
    cost = node_cost(n, gm, float_bytes)
    gathered = [a for a in ops.tensor_args(n) if ops.expert_rows(a)]
    if not gathered:
        return cost
    copies = sum(ops.numel(a.meta["shape"]) - ops.numel(a.args[0].meta["shape"]) for a in gathered)
    return NodeCost(cost.flops, sympy.expand(cost.bytes_moved - copies * float_bytes))


def _facts(gm: fx.GraphModule, layers: list[BlockCost], blocks: list[BlockCost]) -> dict:
    """What divisibility constraints and sizes the planner needs, read off the graph: ``layers``
    are the repeated layer kinds, ``blocks`` every block (embedding and output regions too)."""
    heads, kv_heads = set(), set()
    for n in gm.graph.nodes:
        if n.meta.get("op_class") != "attention" or ops.rule(n.meta["op"]).flops not in ("sdpa", "matmul"):
            continue
        if ops.rule(n.meta["op"]).flops == "sdpa":
            q, k = ops.tensor_args(n)[:2]
            heads.add(int(q.meta["shape"][1]))
            kv_heads.add(_distinct_heads(k))
        else:
            shape = n.meta["shape"]
            if len(shape) == 4 and shape[-1] == shape[-2]:  # scores (b, heads, s, s) = q @ k^T
                heads.add(int(shape[1]))
                kv_heads.add(_distinct_heads(ops.tensor_args(n)[1]))
    tp_dims, expert_counts, vocab = set(), set(), None
    for blk in blocks:
        for g in blk.gemms:
            if g.experts:
                expert_counts.add(g.count)
            if g.role == "column":
                tp_dims.add(g.n)
            elif g.role == "row":
                tp_dims.add(g.k)
            elif g.role == "vocab":
                vocab = g.n
    return {
        "heads": sorted(heads),
        "kv_heads": sorted(kv_heads),
        "experts": max(expert_counts) if expert_counts else 0,
        # key/value heads fewer than a TP degree are shared by the ranks (``passes.tensor_parallel``),
        # so they bound no TP degree (the planner's tp_choices: each must divide it or it them)
        "tp_dims": sorted(tp_dims | heads),
        "hidden": _hidden(layers[0] if layers else blocks[0]),
        "vocab": vocab,
    }


def _tied(gm: fx.GraphModule) -> dict[str, int]:
    """The parameters both the embedding region and the output region read (a token embedding
    tied to the head), found by identity: one parameter read by nodes of both regions, as a
    ``get_attr`` whose users are in both or as modules sharing it. The embedding block counts it
    once; a pipeline whose last chunk is not its first holds a second copy there. ``params`` its
    elements, ``params_tp`` those TP divides (split alike in both copies)."""
    regions: dict[int, set] = {}
    sizes: dict[int, tuple[int, bool]] = {}
    for n in gm.graph.nodes:
        for pname, p in _parameters_read(n, gm):
            if n.op == "get_attr":
                readers = _weight_users(n)
                split = any(_param_tp_sharded(u, "weight") for u in readers)
            else:
                readers, split = [n], _param_tp_sharded(n, pname)
            regions.setdefault(id(p), set()).update(u.meta.get("region") for u in readers)
            numel, was_split = sizes.get(id(p), (p.numel(), False))
            sizes[id(p)] = (numel, was_split or split)
    tied = [sizes[key] for key, where in regions.items() if {"pre", "post"} <= where]
    return {"params": sum(n for n, _ in tied), "params_tp": sum(n for n, split in tied if split)}


def _parameters_read(node: fx.Node, gm: fx.GraphModule) -> list:
    """(name, parameter) of what ``node`` reads: a module's parameters, or the parameter a
    ``get_attr`` names under any of its names (a tied one's second name is not ``is_param``)."""
    if node.op == "get_attr":
        try:
            return [("", gm.get_parameter(node.target))]
        except AttributeError:  # a buffer or a constant
            return []
    return _param_tensors(node, gm)


def _hidden(block: BlockCost) -> int | None:
    """The width of the residual stream: what a layer hands the next, per token."""
    per_token = sympy.simplify(block.boundary_elems / (B * S))
    return int(per_token) if per_token.is_Integer else None


# ops that hand keys on unchanged or repeat them: grouped-query attention's ``repeat_kv``
# (unsqueeze, expand, reshape) or ``repeat_interleave`` on the way to attention
_REPEATS = ("repeat", "repeat_interleave", "contiguous", "clone")


def _distinct_heads(key: fx.Node) -> int:
    """How many different key (or value) heads attention reads: the fewest heads on the way
    back from its key operand through views and repeats, so keys repeated for grouped-query
    attention count once (a (batch, heads, seq, dim) tensor's dim 1)."""
    fewest, node = None, key
    while isinstance(node, fx.Node):
        shape = node.meta.get("shape")
        if isinstance(shape, (tuple, list)) and len(shape) == 4 and isinstance(shape[1], int):
            fewest = shape[1] if fewest is None else min(fewest, shape[1])
        row = ops.rule_of(node)
        if row is None or not (row.alias or node.meta["op"] in _REPEATS) or not node.args:
            break
        node = node.args[0]
    return int(fewest if fewest is not None else key.meta["shape"][1])


def _with_params(nodes: list[fx.Node], gm: fx.GraphModule) -> list[fx.Node]:
    layer = nodes[0].meta["layer"]
    params = [n for n in gm.graph.nodes if n.op == "get_attr" and n.meta.get("layer") == layer]
    return params + nodes


def _param_tensors(node: fx.Node, gm: fx.GraphModule):
    if node.op == "call_module":
        return list(gm.get_submodule(node.target).named_parameters())
    if node.op == "get_attr" and node.meta.get("is_param"):
        return [("", gm.get_parameter(node.target))]
    return []


def _block(
    name: str, count: int, layers: list[int], nodes: list[fx.Node], gm: fx.GraphModule, counted: set[int] = frozenset()
) -> BlockCost:
    """The costs of ``nodes``; parameters whose ids are in ``counted`` (held by another block)
    are not counted again."""
    inside = set(nodes)
    work = _work(nodes)
    params, params_tp, params_experts = _parameter_counts(nodes, gm, counted)
    gemms = _grouped_experts([g for n in nodes for g in _gemms(n, gm)])
    pointwise, pointwise_tp = _pointwise_bytes(nodes, gm)
    saved = _saved_tensors(nodes, inside, gm)
    outputs = [n for n in nodes if n.meta.get("shape") is not None and any(u not in inside for u in n.users)]
    boundary = ops.numel(outputs[-1].meta["shape"]) if outputs else sympy.Integer(0)
    blk = BlockCost(
        name=name,
        count=count,
        layers=layers,
        params=params,
        params_tp=params_tp,
        params_experts=params_experts,
        **work,
        saved=saved,
        collectives=_collectives(nodes),
        boundary_elems=boundary,
        gemms=gemms,
        bytes_pointwise=sympy.expand(pointwise),
        bytes_pointwise_tp=sympy.expand(pointwise_tp),
        kv_elems=sympy.expand(_kv_elems(nodes)),
        scores_per_attention_flop=_scores_per_flop(nodes),
        matmul=_matmul_parts(nodes),
        weighted_outputs=_weighted_outputs(nodes, gm),
        traced_ops=sum(n.op in ("call_function", "call_method", "call_module") for n in nodes),
    )
    blk._nodes = nodes
    return blk


def _scores_per_flop(nodes: list[fx.Node]) -> float:
    """Score elements per attention FLOP over the fused attention kernels among ``nodes``, the
    FLOPs-weighted mean of 1 / (2 (d + dv)) (``flops.sdpa_flops``); 0 without any."""
    weighted = total = 0.0
    for n in nodes:
        if n.meta.get("op_class") != "attention" or ops.rule(n.meta["op"]).flops != "sdpa":
            continue
        q, k, v = ops.tensor_args(n)[:3]
        flops = float(n.meta["cost"].flops.subs({sym: 1024 for sym in n.meta["cost"].flops.free_symbols}))
        weighted += flops / (2 * (int(q.meta["shape"][-1]) + int(v.meta["shape"][-1])))
        total += flops
    return weighted / total if total else 0.0


def _work(nodes: list[fx.Node]) -> dict[str, sympy.Expr | dict[str, sympy.Expr]]:
    """The FLOP and byte fields of :class:`BlockCost` (``flops`` ... ``bytes_by_class``): the
    nodes' costs summed, in total, by op class and over the parts TP, experts and attention do."""
    zero = sympy.Integer(0)
    flops = flops_tp = flops_experts = flops_attn = attn_whole = moved = zero
    by_class: dict[str, sympy.Expr] = {}
    bytes_by_class: dict[str, sympy.Expr] = {}
    for n in nodes:
        cost: NodeCost = n.meta["cost"]
        flops += cost.flops
        moved += cost.bytes_moved
        by_class[n.meta["op_class"]] = by_class.get(n.meta["op_class"], zero) + cost.flops
        bytes_by_class[n.meta["op_class"]] = bytes_by_class.get(n.meta["op_class"], zero) + cost.bytes_moved
        if sharding.splits_work(n):
            flops_tp += cost.flops * _tp_share(n)
        if n.meta["op_class"] == "experts":
            flops_experts += cost.flops
        if n.meta["op_class"] == "attention":
            flops_attn += cost.flops
            attn_whole += 0 if sharding.splits_work(n) else cost.flops
    return {
        "flops": sympy.expand(flops),
        "flops_tp": sympy.expand(flops_tp),
        "flops_experts": sympy.expand(flops_experts),
        "flops_attention": sympy.expand(flops_attn),
        "flops_attention_whole": sympy.expand(attn_whole),
        "bytes_moved": sympy.expand(moved),
        "flops_by_class": {k: sympy.expand(v) for k, v in by_class.items()},
        "bytes_by_class": {k: sympy.expand(v) for k, v in bytes_by_class.items()},
    }


def _parameter_counts(nodes: list[fx.Node], gm: fx.GraphModule, counted: set[int]) -> tuple[int, int, int]:
    """(all, divided among TP ranks, of routed experts) parameters ``nodes`` read, each once and
    none whose id is in ``counted``."""
    params = params_tp = params_experts = 0
    seen_params: set[int] = set(counted)
    split_experts: set[int] = set()  # parameters read by several names count once
    split_tp: set[int] = set()
    for n in nodes:
        read = _parameters_read(n, gm)  # a tied parameter's second name too
        for pname, p in read:
            if id(p) in seen_params:
                continue
            seen_params.add(id(p))
            params += p.numel()
            if _param_tp_sharded(n, pname):
                params_tp += p.numel()
            if n.op == "call_module" and n.meta["op_class"] == "experts":  # an expert's own nn.Linear
                split_experts.add(id(p))
                params_experts += p.numel()
        if n.op == "get_attr" and read and id(read[0][1]) not in counted:
            users, p = list(n.users), read[0][1]
            if id(p) not in split_experts and _feeds_experts(users):
                split_experts.add(id(p))
                params_experts += p.numel()
            if id(p) not in split_tp and any(_param_tp_sharded(u, "weight") for u in _weight_users(n)):
                split_tp.add(id(p))
                params_tp += p.numel()
    return params, params_tp, params_experts


def _feeds_experts(users: list[fx.Node]) -> bool:
    """Whether an expert GEMM reads the parameter these nodes read, directly or through weight
    views (a cast, a transpose, the ``torch.stack`` of an expert loop's parameters)."""
    return any(u.meta.get("op_class") == "experts" or ops.is_weight(u) and _feeds_experts(list(u.users)) for u in users)


def _pointwise_bytes(nodes: list[fx.Node], gm: fx.GraphModule) -> tuple[sympy.Expr, sympy.Expr]:
    """HBM traffic of every node but the weighted matmuls, and the part inside TP regions."""
    pointwise = pointwise_tp = sympy.Integer(0)
    for n in nodes:
        if _gemm(n, gm) is None:
            pointwise += n.meta["cost"].bytes_moved
            if sharding.splits_work(n):
                pointwise_tp += n.meta["cost"].bytes_moved
    return pointwise, pointwise_tp


def _weighted_outputs(nodes: list[fx.Node], gm: fx.GraphModule) -> list[SavedTensor]:
    """The outputs of the ops other than weighted matmuls that combine a parameter with an
    activation (a norm's scale, ``x * gamma``, ``x + bias``): a parameter's gradient is computed
    from its consumer's output gradient, which a split backward's input pass keeps for the
    weight pass, as it keeps a matmul's."""
    out = []
    for n in nodes:
        if n.op in ("get_attr", "placeholder", "output") or n.meta.get("shape") is None or ops.is_weight(n):
            continue
        if _gemm(n, gm) is not None or not (dtype := n.meta.get("dtype")) or not dtype.is_floating_point:
            continue
        args = ops.tensor_args(n)
        weights = [a for a in args if ops.is_weight(a) and _root_parameter(a, gm)]
        if n.op == "call_module":
            weights += [p for _, p in _param_tensors(n, gm) if p.requires_grad]
        activations = [a for a in args if not ops.is_weight(a) and a.meta.get("dtype") is not None]
        if not weights or not any(a.meta["dtype"].is_floating_point for a in activations):
            continue
        out.append(
            SavedTensor(
                "weight_grad",
                ops.numel(n.meta["shape"]),
                None,
                n.meta.get("tp") == "sharded",
                _per_token(n.meta["shape"]),
                n.name,
            )
        )
    return out


def _root_parameter(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``node`` (an ``ops.is_weight`` node) is a parameter's view or cast, not a buffer's."""
    while node.op != "get_attr":
        node = node.args[0]
    return bool(_parameters_read(node, gm))


def _tp_share(n: fx.Node) -> sympy.Rational:
    """The share of ``n``'s work TP divides, where it splits work at all: all of it, but for a
    column whose one-head parts every rank computes whole (``sharding.single_heads``)."""
    whole, _ = sharding.single_heads(n) if n.meta.get("tp_role") == "column" else (0, [])
    if not whole:
        return sympy.Integer(1)
    features = int(n.meta["shape"][-1])
    return sympy.Rational(features - whole, features)


def _gemms(n: fx.Node, gm: fx.GraphModule) -> list[Gemm]:
    """``n``'s weighted product as :class:`Gemm` s: a column whose one-head parts every TP rank
    computes whole (``sharding.single_heads``) is two, the column of the rest and those parts,
    replicated; others are one (none for a node that is no weighted product)."""
    g = _gemm(n, gm)
    if g is None:
        return []
    whole = sharding.single_heads(n)[0] if g.role == "column" else 0
    if not whole:
        return [g]
    return [*([replace(g, n=g.n - whole)] if whole < g.n else []), replace(g, n=whole, role="replicated")]


def _gemm(n: fx.Node, gm: fx.GraphModule) -> Gemm | None:
    if n.meta.get("shape") is None or not weighted_matmul(n, gm):
        return None
    w = ops.weight_of(n, gm)
    out = n.meta["shape"]
    role = n.meta.get("tp_role", "replicated")
    experts = n.meta.get("op_class") == "experts"
    flops = matmul_flops(n, gm)
    # the contraction as the op table's FLOP count reads it (addmm(bias, x, w) contracts x's last dim)
    k = int(sympy.simplify(flops / (2 * ops.numel(out))))
    # output features: the weight's other dimension (whichever side of the product it is on)
    n_out = int(ops.numel(w[-2:]) // k) if len(w) >= 2 else int(out[-1])
    # stacked experts: (E, C, k) @ (E, k, n), grouped rows, or rows gathered per routed token
    batch = int(w[0]) if len(w) == 3 else 1
    # rows per expert: C of a batched product; routed rows shared evenly (balanced routing)
    m = sympy.expand(flops / (2 * n_out * k * batch))
    count = ops.expert_count(n, gm) if experts else None
    kind = n.meta.get("matmul_kind", "mlp")
    heads = sharding.attention_heads(n) if role == "column" else 0
    return Gemm(m=m, n=n_out, k=k, batch=batch, role=role, experts=experts, count=count or 1, kind=kind, heads=heads)


def weighted_matmul(n: fx.Node, gm: fx.GraphModule) -> bool:
    """A matmul by a parameter (a linear layer, ``x @ W``, stacked experts' product)."""
    r = ops.rule(n.meta.get("op", ""))
    return r is not None and r.flops == "matmul" and ops.weight_of(n, gm) is not None


def annotate_kinds(gm: fx.GraphModule) -> None:
    """``node.meta["matmul_kind"]`` on every weighted matmul: ``router`` and ``experts`` by op
    class, ``head`` after the layers (or the vocabulary-parallel product), and inside a layer
    ``attention`` for the projections that feed its attention (any path within the layer: MLA's
    down- and up-projections too) or that read its output with no weighted matmul between (the
    output projection), ``mlp`` for the rest."""
    computing = ("call_function", "call_method", "call_module")
    weighted = {n for n in gm.graph.nodes if n.op in computing and weighted_matmul(n, gm)}
    near_attention: set[fx.Node] = set()

    def walk(start: list[fx.Node], layer, onward, through_matmuls: bool) -> None:
        """Collect the weighted matmuls reached from ``start`` within ``layer`` along ``onward``
        (inputs or users), through other matmuls only if ``through_matmuls``, never past a norm
        going forward."""
        todo, seen = list(start), set()
        while todo:
            n = todo.pop()
            if n in seen or n.meta.get("layer") != layer:
                continue
            seen.add(n)
            if n in weighted:
                near_attention.add(n)
                if not through_matmuls:
                    continue
            if through_matmuls or n.meta.get("op_class") != "norm":
                todo.extend(onward(n))

    for a in gm.graph.nodes:
        if a.meta.get("op_class") == "attention" and a.meta.get("layer") is not None:
            walk(a.all_input_nodes, a.meta["layer"], lambda n: n.all_input_nodes, True)  # what feeds it
            walk(list(a.users), a.meta["layer"], lambda n: list(n.users), False)  # what reads its output
    for n in weighted:
        cls = n.meta.get("op_class")
        if cls in ("router", "experts"):
            n.meta["matmul_kind"] = cls
        elif n.meta.get("tp_role") == "vocab" or n.meta.get("region") == "post":
            n.meta["matmul_kind"] = "head"
        else:
            n.meta["matmul_kind"] = "attention" if n in near_attention else "mlp"


def _grouped_experts(gemms: list[Gemm]) -> list[Gemm]:
    """``gemms`` with the one-expert products of a loop over E experts (an ``nn.ModuleList`` of
    MLPs) grouped E at a time into one product of ``batch`` E, as a grouped GEMM runs them."""
    out, loops = [], {}
    for g in gemms:
        if g.experts and g.batch == 1 and g.count > 1:
            loops.setdefault((g.m, g.n, g.k, g.role, g.count), []).append(g)
        else:
            out.append(g)
    for (m, n, k, role, count), same in loops.items():
        for start in range(0, len(same), count):
            batch = len(same[start : start + count])
            out.append(Gemm(m=m, n=n, k=k, batch=batch, role=role, experts=True, count=count, kind="experts"))
    return out


def _kv_elems(nodes: list[fx.Node]) -> sympy.Expr:
    """Keys and values entering attention: what context parallelism moves between ranks."""
    total = sympy.Integer(0)
    for n in nodes:
        if n.meta.get("op_class") != "attention":
            continue
        r = ops.rule(n.meta["op"])
        args = ops.tensor_args(n)
        if r.flops == "sdpa":
            total += ops.numel(args[1].meta["shape"]) + ops.numel(args[2].meta["shape"])
        elif r.flops == "matmul" and len(args) >= 2:
            total += ops.numel(args[1].meta["shape"])  # K^T for the scores, V for the output
    return total


def _weight_users(param: fx.Node) -> list[fx.Node]:
    """Matmuls that use this parameter, directly or through a view/cast."""
    out = []
    for u in param.users:
        if ops.is_weight(u) and u.op != "get_attr":
            out.extend(_weight_users(u))
        else:
            out.append(u)
    return out


def _param_tp_sharded(node: fx.Node, pname: str) -> bool:
    role = node.meta.get("tp_role")
    if role == "column":  # but one whose one-head parts every rank keeps: its weight stays whole
        return not sharding.single_heads(node)[0]
    if role == "vocab":
        return True
    return role == "row" and pname != "bias"


# ---------------------------------------------------------------------------------------------
# Saved tensors


def _storage_producers(nodes: list[fx.Node]) -> dict[int, fx.Node]:
    first: dict[int, fx.Node] = {}
    for n in nodes:
        st = n.meta.get("storage")
        if st is not None and st not in first:
            first[st] = n
    return first


def _root(node: fx.Node, producers: dict[int, fx.Node]) -> fx.Node:
    st = node.meta.get("storage")
    return producers.get(st, node) if st is not None else node


def _saved_inputs(n: fx.Node) -> list[tuple[str, fx.Node | None, str]]:
    """(code, tensor, why) for what ``n`` keeps; tensor None for masks and LSE (new tensors)."""
    r = ops.rule(n.meta.get("op", ""))
    if r is None or not n.meta.get("requires_grad"):
        return []
    args = ops.tensor_args(n)
    kept = []
    for code in r.saves:
        if code == "partner":
            # a module's own weight is the implicit second operand (and needs a gradient)
            owns_weight = n.op == "call_module"
            for i, a in enumerate(args):
                others = args[:i] + args[i + 1 :]
                if owns_weight or any(o.meta.get("requires_grad") for o in others):
                    kept.append(("in", a, "partner"))
        elif code.startswith("in") and code[2:].isdigit():
            idx = int(code[2:])
            if idx < len(args):
                kept.append(("in", args[idx], code))
        elif code == "out":
            kept.append(("out", n, code))
        elif code == "mask":
            if _dropout_active(n):
                kept.append(("mask", None, code))
        elif code == "sdpa":
            kept.extend(("in", a, "sdpa") for a in args[:3])
            kept.append(("out", n, "sdpa"))
            kept.append(("lse", None, "sdpa"))
        elif code == "logprobs":
            kept.append(("logprobs", None, code))
    return kept


def _dropout_active(n: fx.Node) -> bool:
    p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
    training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
    if n.op == "call_module":
        return False  # nn.Dropout's p is read from the module in _module_dropout
    return bool(training) and isinstance(p, (int, float)) and p > 0


def _saved_tensors(nodes: list[fx.Node], inside: set[fx.Node], gm: fx.GraphModule) -> list[SavedTensor]:
    producers = _storage_producers(nodes)
    records: dict[object, SavedTensor] = {}
    keepers: dict[object, set] = {}  # storage -> the matmul kinds keeping it (None: another op too)
    for n in nodes:
        for code, t, _why in _saved_inputs(n) + _module_dropout(n, gm):
            if code in ("mask", "lse", "logprobs"):
                records[(code, n.name)] = _virtual(code, n)
                continue
            if t is None or t.meta.get("shape") is None or ops.is_weight(t) or t.op == "get_attr":
                continue
            root = _root(t, producers)
            key = root.meta.get("storage", root.name)
            keepers.setdefault(key, set()).add(n.meta.get("matmul_kind") if code == "in" else None)
            if key in records:
                continue
            external = root not in inside or root.op == "placeholder"
            records[key] = SavedTensor(
                category=saved_category(root, n, external),
                elems=ops.numel(root.meta["shape"]),
                fixed_bytes=None if root.meta["dtype"].is_floating_point else elem_bytes(root.meta["dtype"], 2),
                tp_sharded=root.meta.get("tp") == "sharded",
                per_token=_per_token(root.meta["shape"]),
                producer=root.name,
            )
    for key, kinds in keepers.items():
        if None not in kinds and key in records:
            records[key] = replace(records[key], matmul_kinds=frozenset(kinds))
    return list(records.values())


def _module_dropout(n: fx.Node, gm: fx.GraphModule):
    if n.op == "call_module" and n.meta.get("op") == "dropout" and n.meta.get("requires_grad"):
        mod = gm.get_submodule(n.target)
        if mod.training and mod.p > 0:
            return [("mask", None, "mask")]
    return []


def _virtual(code: str, n: fx.Node) -> SavedTensor:
    shape = n.meta["shape"]
    if code == "mask":
        return SavedTensor(
            "attention" if n.meta["op_class"] == "attention" else "dropout_mask",
            ops.numel(shape),
            1,
            n.meta.get("tp") == "sharded",
            _per_token(shape),
            n.name,
        )
    if code == "lse":
        return SavedTensor("attention", ops.numel(shape[:-1]), 4, n.meta.get("tp") == "sharded", True, n.name)
    logits = ops.tensor_args(n)[0]
    return SavedTensor("loss", ops.numel(logits.meta["shape"]), 4, logits.meta.get("tp") == "sharded", True, n.name)


def _per_token(shape) -> bool:
    syms = set().union(*(sympy.sympify(d).free_symbols for d in shape)) if shape else set()
    return {B, S} <= syms


# ---------------------------------------------------------------------------------------------
# Recompute closure and communication


def _closure_flops(blk: BlockCost, dropped: frozenset[str]) -> sympy.Expr:
    """FLOPs to rebuild every dropped saved tensor from the kept ones (and the layer input)."""
    rerun = _rerun(blk, dropped)
    return sympy.expand(sympy.Add(*(n.meta["cost"].flops for n in rerun)))  # one flattening, not one per term


def _rerun(blk: BlockCost, dropped: frozenset[str]) -> set[fx.Node]:
    """The nodes recomputation reruns to rebuild every dropped saved tensor from the kept ones
    (and the layer input)."""
    nodes = blk._nodes
    inside = set(nodes)
    by_name = {n.name: n for n in nodes}
    producers = _storage_producers(nodes)
    kept_storages = set()
    need: list[fx.Node] = []
    for t in blk.saved:
        node = by_name.get(t.producer)
        if node is None:
            continue
        if t.category in dropped and t.category != "layer_input":
            need.append(node)
        else:
            kept_storages.add(node.meta.get("storage"))
    rerun: set[fx.Node] = set()
    while need:
        n = need.pop()
        if n in rerun or n not in inside or n.op in ("placeholder", "get_attr"):
            continue
        rerun.add(n)
        for a in n.all_input_nodes:
            root = _root(a, producers)
            if root not in inside or root.meta.get("storage") in kept_storages and root is not n:
                continue
            need.append(a)
    return rerun


def _matmul_parts(nodes) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
    """Matmul-class forward FLOPs of ``nodes`` (``ops`` rows counted as ``matmul`` or ``sdpa``):
    (those of the attention core TP splits by heads, those TP divides among its ranks otherwise:
    sharded products and the routed experts, whose rows the TP ranks share, those every TP rank
    does whole, those of an attention core every TP rank does whole)."""
    parts = [sympy.Integer(0)] * 4
    for n in nodes:
        r = ops.rule_of(n)
        if r is None or r.flops not in ("matmul", "sdpa") or "cost" not in n.meta:
            continue
        if n.meta.get("op_class") == "attention":
            i = 0 if sharding.splits_work(n) else 3
        elif n.meta.get("op_class") == "experts":
            i = 1
        elif sharding.splits_work(n):
            share = _tp_share(n)
            parts[1] += n.meta["cost"].flops * share
            parts[2] += n.meta["cost"].flops * (1 - share)
            continue
        else:
            i = 2
        parts[i] += n.meta["cost"].flops
    return tuple(sympy.expand(p) for p in parts)


def _collectives(nodes: list[fx.Node]) -> list[Collective]:
    out = []
    column_inputs = set()
    for n in nodes:
        role = n.meta.get("tp_role")
        matmul = ops.rule_of(n) is not None and ops.rule_of(n).flops == "matmul"
        if role == "row" or (role == "vocab" and not matmul):
            # a row's partial sums, or a vocabulary-parallel embedding's (each rank looks up the
            # tokens of its rows): all-reduced, or reduce-scattered under sequence parallelism
            out.append(Collective("tp", "all_reduce", ops.numel(n.meta["shape"]), backward=False))
        elif role in ("column", "vocab"):  # the vocabulary-parallel head reads its input as a column does
            act = [a for a in ops.tensor_args(n) if not ops.is_weight(a)]
            key = act[0].meta.get("storage") if act else None
            if key not in column_inputs:
                column_inputs.add(key)
                out.append(Collective("tp", "all_reduce", ops.numel(act[0].meta["shape"]), backward=True))
    for a in _dispatched(nodes):
        out.append(Collective("ep", "all_to_all", ops.numel(a.meta["shape"]), backward=True, source=a.name))
    for w in _stacked_expert_weights(nodes):
        out.append(Collective("ep", "weights", ops.numel(w.meta["shape"]), backward=True, source=w.name))
    return out


def _stacked_expert_weights(nodes: list[fx.Node]) -> list[fx.Node]:
    """The ``torch.stack`` s of parameters that experts products read (an ``nn.ModuleList`` of
    experts made grouped by ``passes.moe_forms``): expert parallelism keeps ``1/ep`` of each
    expert parameter's rows on every rank and exchanges the stack into its experts' whole weights
    by one all-to-all per forward, their gradients back by another."""
    return [n for n in nodes if ops.stacked_parameters(n) is not None and _feeds_experts(list(n.users))]


def _dispatched(nodes: list[fx.Node]) -> list[fx.Node]:
    """The tokens entering routed experts from outside them, once per storage: what expert
    parallelism sends to the experts' ranks (one collective per dispatch; the cost model prices
    its combine, the same size, with it). Whatever form the experts take (grouped, batched,
    stacked, a loop of MLPs), that is the input of their first products, not of a second one
    that reads the first's output."""
    found, seen = [], set()
    for n in nodes:
        if n.meta.get("op_class") != "experts":
            continue
        for a in ops.tensor_args(n):
            floating = a.meta.get("dtype") is not None and a.meta["dtype"].is_floating_point
            if not floating or ops.is_weight(a) or a.meta.get("storage") in seen or _from_experts(a):
                continue
            seen.add(a.meta.get("storage"))
            found.append(a)
    return found


def _from_experts(node: fx.Node, limit: int = 16) -> bool:
    """Whether ``node`` is computed from an experts product through pointwise ops and views."""
    frontier = [node]
    for _ in range(limit):
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                if a.meta.get("op_class") == "experts":
                    return True
                if ops.carries_values(ops.rule_of(a)):
                    nxt.append(a)
        frontier = nxt
    return False


def category_subsets(categories: list[str]):
    """Every subset of the recomputable categories, smallest first."""
    for r in range(len(categories) + 1):
        yield from (frozenset(c) for c in itertools.combinations(categories, r))

"""Capture: trace a model, built on the meta device, into the annotated fx graph (``autoshard.ir``).

The steps, one module each, in the order :func:`capture` runs them:

1. ``trace``: the training forward (model, then loss) as an fx graph, by ``torch.fx.symbolic_trace``
   or, where that fails, ``torch.export``; a constant the forward makes (a list index, a
   ``torch.tensor`` of data) is a non-persistent buffer holding its value;
2. ``autoshard.passes.canonical``: the first pass, canonicalisation, makes one form of the graph
   whichever tracer produced it (no export guards or metadata asserts, no device constants); the
   cost model reads that form, so it runs here rather than with the plan's passes;
3. ``structure``: the repeated layer stack, and on every node its module path, layer and region;
4. ``shapes``: shapes symbolic in batch ``b`` and sequence ``s``, each repeated layer propagated
   once, and which values need gradients;
5. ``structure.annotate_ops``: the op table's name and class of every node; the layers grouped
   into :class:`LayerKind` s.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from autoshard import modelfile, passes
from autoshard.capture import shapes, structure
from autoshard.capture.init import Init, lifted, record_build
from autoshard.capture.structure import LayerKind
from autoshard.capture.timing import phase
from autoshard.capture.trace import BATCH_HINT, TrainingForward, causal_lm_loss, trace
from autoshard.gcpolicy import fewer_collections
from autoshard.runtime.stages import replay


@dataclass
class Captured:
    """The traced training forward and what capture learnt about its structure."""

    graph_module: fx.GraphModule
    model: nn.Module
    tracer: str  # "symbolic_trace" or "export"
    stack_path: str | None  # module path of the repeated-layer container ("layers")
    num_layers: int
    kinds: list[LayerKind]
    input_names: list[str]
    source: str | None = None
    layer_nodes: dict[int, list[fx.Node]] = field(default_factory=dict)
    # traced parameter/buffer name -> how the model initialises it (``init.record_build``),
    # recorded when first read (``RecordedInits``); None where no recording was asked for
    inits: Mapping[str, Init] | None = None
    # assumptions capture made, for the plan to state (how a data-dependent size was estimated)
    notes: list[str] = field(default_factory=list)

    def kind_of(self, layer: int) -> LayerKind:
        return next(k for k in self.kinds if layer in k.layers)

    def region_nodes(self, region: str) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.meta.get("region") == region]

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def capture_file(spec: str, config: str | None, seq: int, batch: int = BATCH_HINT, observe=None) -> Captured:
    """Load ``model.py[:builder]``, build ``config`` on the meta device and capture it
    (``observe``: see ``capture``)."""
    with phase("build on meta"), fewer_collections():
        mf = modelfile.load(spec)
        model = mf.build(config)
        inputs = mf.sample_inputs(config, batch, seq)

    def record() -> dict[str, Init]:
        with phase("init recorder"):
            return record_build(mf.build, config)[1]

    inits = RecordedInits(record)
    return capture(model, inputs, loss=mf.loss, source=str(mf.path), inits=inits, observe=observe)


class RecordedInits(Mapping):
    """``name -> Init``, recorded on first read. Recording the initialisation means building the
    model again under the recorder (``init.record_build``), seconds for a model of hundreds of
    billions of parameters, which planning never needs: only emitting a program reads every
    entry, and canonicalisation reads one where a mask is held in a buffer. ``record`` returns
    the table; the builder is deterministic, so the second build names its tensors as the
    first."""

    def __init__(self, record: Callable[[], Mapping[str, Init]]):
        self._record: Callable[[], Mapping[str, Init]] | None = record
        self._table: Mapping[str, Init] | None = None

    @property
    def recorded(self) -> bool:
        return self._table is not None

    def _get(self) -> Mapping[str, Init]:
        if self._table is None:
            self._table = dict(self._record())
            self._record = None
        return self._table

    def __getitem__(self, name: str) -> Init:
        return self._get()[name]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __deepcopy__(self, memo) -> RecordedInits:
        return self  # its entries are never changed, only read

    def __reduce__(self):
        return dict, (dict(self._get()),)  # pickled (a cached problem, a process) as the table


def capture(
    model: nn.Module,
    inputs: tuple | None = None,
    *,
    seq: int = 128,
    loss=None,
    source: str | None = None,
    inits: Mapping[str, Init] | None = None,
    observe=None,
) -> Captured:
    """Trace ``model`` (live or on meta) with ``inputs`` (default: token ids of shape (2, seq));
        ``inits``, from ``init.record_build``, say how the model initialises its tensors (the constants
    lifted from its forward take their captured values); ``observe``
        (``passes.contract.Observer``) sees the graph before and after canonicalisation."""
    with fewer_collections():  # what capture makes lives on: collecting finds little (``gcpolicy``)
        return _capture(model, inputs, seq, loss, source, inits, observe)


def _capture(model, inputs, seq, loss, source, inits, observe) -> Captured:
    """``capture``'s steps, in the order the package docstring gives."""
    if inputs is None:
        inputs = (torch.zeros(BATCH_HINT, seq, dtype=torch.long, device="meta"),)
    with phase("trace"):
        gm, tracer, names = trace(model, inputs, loss, source, follow_bf16=_on_meta(model))
        if inits is not None:
            inits = _traced(inits, _lifted(gm, model))
    with phase("canonicalise"):
        gm = passes.canonical(gm, inputs, observe, _recorded_values(inits, gm))
        # what nothing reads (a mask built for a kind of layer the model has none of, as Gemma3's
        # global-attention mask with only sliding layers) would be run, and sharded, for nothing
        if gm.graph.eliminate_dead_code():
            gm.recompile()
    with phase("structure"):
        stack = structure.layer_stack(model)
        structure.annotate_modules(gm, model, stack)
        layer_nodes = structure.layer_nodes(gm)
    with phase("shape propagation"):
        if tracer == "symbolic_trace":
            keys, notes = shapes.propagate(gm, inputs, layer_nodes, model)
        else:
            keys, notes = shapes.read_export_shapes(gm, layer_nodes)
        shapes.requires_grad(gm)
    with phase("structure"):
        structure.annotate_ops(gm)
    return Captured(
        graph_module=gm,
        model=model,
        tracer=tracer,
        stack_path=stack[0] if stack else None,
        num_layers=len(stack[1]) if stack else 0,
        kinds=structure.group_kinds(keys),
        input_names=names,
        source=source,
        layer_nodes=layer_nodes,
        inits=inits,
        notes=notes,
    )


def _on_meta(model: nn.Module) -> bool:
    """Whether ``model`` lives on the meta device, where an exported graph takes the dtype flow
    the model has with bf16 parameters (``trace``'s ``follow_bf16``). A live model (the Python
    API's) keeps its graph as traced: traced on real tensors, its graph has views a meta trace
    does not, and the two do not align node by node."""
    return all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def _recorded_values(inits: Mapping[str, Init] | None, gm: fx.GraphModule):
    """``name -> value`` of a buffer the model built on meta, replayed from its recorded
    initialisation on CPU where that has no randomness (two seeds give one value); None
    otherwise. What canonicalisation's mask checks read (``passes.canonical``)."""
    if inits is None:
        return None

    def value(name: str) -> torch.Tensor | None:
        init = inits.get(name)
        meta = _meta_buffer(gm, name)
        if init is None or init.problem or meta is None:
            return None
        try:
            drawn = [replay(init.steps, tuple(meta.shape), torch.Generator().manual_seed(s)) for s in (0, 1)]
        except Exception:  # noqa: BLE001 - a program that does not replay here: no value to check
            return None
        return drawn[0] if torch.equal(drawn[0], drawn[1]) else None

    return value


def _meta_buffer(gm: fx.GraphModule, name: str) -> torch.Tensor | None:
    try:
        return gm.get_buffer(name)
    except AttributeError:
        return None


def _lifted(gm: fx.GraphModule, model: nn.Module) -> dict[str, Init]:
    """The initialisations of the buffers the traced graph holds and ``model`` does not: the
    constants lifted from its forward (``trace.lifted_as_buffers``), each its captured value."""
    prefix = structure._WRAPPER_PREFIX
    held = {f"{prefix}{k}" for k, _ in model.named_parameters(remove_duplicate=False)}
    held |= {f"{prefix}{k}" for k, _ in model.named_buffers(remove_duplicate=False)}
    return {k: lifted(v) for k, v in gm.named_buffers() if k not in held}


def _traced(inits: Mapping[str, Init], lifted_: dict[str, Init]) -> RecordedInits:
    """The model's ``inits`` (recorded when first read) named as the graph names them, with the
    constants ``lifted_`` from its forward."""
    return RecordedInits(lambda: {**_traced_names(inits), **lifted_})


def _traced_names(inits: Mapping[str, Init]) -> dict[str, Init]:
    """``inits`` named as the traced graph names the model's tensors (``TrainingForward.model``)."""
    prefix = structure._WRAPPER_PREFIX
    return {
        f"{prefix}{k}": dataclasses.replace(v, tied_to=v.tied_to and f"{prefix}{v.tied_to}") for k, v in inits.items()
    }


__all__ = [
    "BATCH_HINT",
    "Captured",
    "Init",
    "LayerKind",
    "RecordedInits",
    "TrainingForward",
    "capture",
    "capture_file",
    "causal_lm_loss",
    "record_build",
]


class _CallableModule(types.ModuleType):
    """Importing this package rebinds the attribute ``autoshard.capture`` from the public function
    to the package; calling the package runs the function, so ``autoshard.capture(model)`` works
    whichever one the attribute is."""

    def __call__(self, model, inputs=None, *, seq: int = 128, loss=None) -> Captured:
        return capture(model, inputs, seq=seq, loss=loss)


sys.modules[__name__].__class__ = _CallableModule

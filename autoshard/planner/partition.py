"""Stage partition with CP-SAT: how many layers each virtual stage takes, so that the slowest
pipeline rank is as fast as possible, every rank's memory fits, and the data-parallel
communication each rank exposes after its last backward is counted.

Layers come in runs of one kind (3 dense then 58 MoE layers, say). A boundary ``e`` (the index of
the first layer of the next stage) enters every per-layer sum through ``clamp(e - start, 0, len)``
per run, so all sums stay linear and one set of auxiliary variables serves every quantity.
The embedding sits on the first virtual stage and the output head with the loss on the last; they
may hold no layers at all (LLaMA-3 put only the embedding on its first chunk).

Each pipeline rank may also choose its recompute set (``Quantities.options``), jointly with the
split: in 1F1B-like orders the first rank holds the most micro-batches in flight and the last the
fewest, so one set for all wastes compute on the later ranks. The choice is per rank, not per
layer: a rank's chunks share its memory, and a per-rank set is what the emitted program's
checkpoint wrappers take per stage. CP-SAT gets one boolean per rank and set, exactly one true,
and per chunk its quantities under the chosen set; the exact paths take, per rank and time
bound, the most layers any set allows (``_best_counts_choice``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from autoshard.ir.schedules import Point, peak, point_matrix

US = 1e6  # CP-SAT works in integers: times in microseconds
MEM_UNIT = 2**20  # memory in MiB
SHARE_UNIT = 1000  # overlap shares in thousandths
UNLIMITED = float(2**60)  # a capacity meaning no memory limit (in integers CP-SAT takes)
PREFIX_ENUMERATION = 6  # a leading run this short is split by enumeration, not CP-SAT

KEYS = ("time", "fwd", "bwd", "act", "held", "state", "grad", "dp_time", "dp_gather", "dp_micro")
# scale of each quantity in the model's integers: times in microseconds, memory in MiB (the
# in-flight counts it is multiplied by are whole micro-batches per chunk)
_SCALE = {key: US for key in KEYS} | {key: 1 / MEM_UNIT for key in ("act", "held", "state", "grad")}


@dataclass
class Quantities:
    """Per-layer-kind values (one copy, one micro-batch) and the fixed parts of one candidate."""

    time: list[float]  # critical-path seconds per layer of each kind
    fwd: list[float]
    bwd: list[float]  # backward (b + w) per layer
    act: list[float]  # bytes kept per layer per micro-batch
    held: list[float]  # bytes held per layer per micro-batch waiting for a deferred weight pass
    state: list[float]  # model-state bytes per layer, but the gradients
    grad: list[float]  # gradient bytes per layer (made at its chunk's first backward)
    dp_time: list[float]  # seconds of gradient reduction per layer (bandwidth part)
    dp_gather: list[float]  # seconds of parameter gathering per layer
    dp_micro: list[float]  # ZeRO-3 per micro-batch seconds per layer
    pre: dict  # same keys, for the embedding block
    post: dict
    p2p: float  # per chunk boundary, both directions
    dp_latency: tuple[float, float, float]  # constant part: after backward, before forward, per micro-batch
    buffers: float  # bytes every rank needs besides states and activations
    post_buffers: float  # extra bytes on the rank holding the output head
    capacity: float  # usable bytes per GPU
    # per rank: the schedule's ``occupancy`` (micro-batches held and waiting per chunk at each
    # moment that can be the peak), over the rank's chunks in model order
    occupancy: list[tuple[Point, ...]] = field(default_factory=list)
    boundary: float = 0.0  # bytes of the output a chunk keeps per micro-batch in flight (all but the last)
    rank_buffers: list[float] = field(default_factory=list)  # per rank: bytes besides ``buffers``
    # share of the data-parallel traffic behind its window the program hides (``Hardware.overlap``)
    dp_share: float = 1.0
    # what each rank may use instead, one per other recompute set (``Partition.rank_option``):
    # the same fields under that set; empty where every rank takes this one
    options: list[Quantities] = field(default_factory=list)

    def choices(self) -> list[Quantities]:
        """Option 0 (this one) and the alternatives a rank may take instead."""
        return [self, *self.options]

    def buffers_of(self, r: int, last: int) -> float:
        """Rank ``r``'s bytes besides states and activations (``last``: the rank of the head)."""
        return (
            self.buffers
            + (self.post_buffers if r == last else 0.0)
            + (self.rank_buffers[r] if self.rank_buffers else 0.0)
        )


@dataclass
class Partition:
    stage_layers: list[int]
    t_max: float  # slowest rank, one micro-batch, seconds
    dp_exposed: float  # slowest rank's exposed data-parallel time per step
    memory: list[float]  # bytes per rank
    optimal: bool
    rank_option: list[int] = field(default_factory=list)  # per rank: its ``Quantities.choices`` index


def _runs(kinds: list[int]) -> list[tuple[int, int, int]]:
    runs, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append((kinds[start], start, i - start))
            start = i
    return runs


def exact(kinds: list[int], fixed: tuple[int, ...] | None) -> bool:
    """Whether ``solve`` takes an exact path (no CP-SAT): then, where the best split with no
    memory limit fits, it is the very split found under the limit (the same scan, each count
    no higher than memory allows)."""
    runs = _runs(kinds)
    return fixed is None and (len(runs) == 1 or (len(runs) == 2 and runs[0][2] <= PREFIX_ENUMERATION))


def solve(
    kinds: list[int],
    q: Quantities,
    pp: int,
    v: int,
    chunk_rank,
    microbatches: int,
    fixed: tuple[int, ...] | None = None,
    time_limit_s: float = 20.0,
) -> Partition | None:
    """Optimal contiguous split of the layers into ``pp*v`` virtual stages, or None if no split
    fits in memory. Unless ``fixed``, a rank's layers are spread over its chunks as evenly as
    whole layers allow, earlier chunks first and the embedding's and head's chunks last
    (``_spread``): the schedules' fill and drain assume chunks of one rank take equal times, and
    a rank's memory depends on which chunk holds what (``q.occupancy``)."""
    runs = _runs(kinds)
    if fixed is None and len(runs) == 1:
        return _solve_per_rank(len(kinds), q, pp, v, chunk_rank, microbatches, time_limit_s)
    if fixed is None and len(runs) == 2 and runs[0][2] <= PREFIX_ENUMERATION:
        return _solve_prefix(kinds, q, pp, v, chunk_rank, microbatches)
    split = _SplitModel(kinds, q, pp, v, chunk_rank, microbatches)
    split.add_boundaries()
    if fixed is not None:
        split.add_fixed_split(fixed)
    else:
        split.add_even_spread()
    split.add_clamps()
    split.add_choices()
    split.add_maxima()
    # rank by rank, each family in turn: the constraint order (and so the search) CP-SAT has always had
    for r, cs in split.ranks.items():
        split.add_rank_time(r, cs)
        split.add_rank_memory(r, cs)
        split.add_rank_exposure(r, cs)
    split.set_objective()
    found = split.solve(time_limit_s)
    if found is not None and split.pick:
        found = split.least_recompute(*found, time_limit_s)
    return None if found is None else split.read_partition(*found)


class _SplitModel:
    """The CP-SAT model of one stage partition: chunk boundaries, their clamp terms per run, and
    per-rank time, memory and exposed data-parallel time under the objective's two maxima."""

    def __init__(self, kinds: list[int], q: Quantities, pp: int, v: int, chunk_rank, microbatches: int):
        # imported here: OR-Tools' CP-SAT module pulls in pandas (0.4 s), and the shapes solve()
        # handles exactly, the common ones, never need it
        from ortools.sat.python import cp_model

        self.cp_model = cp_model
        self.model = cp_model.CpModel()
        self.kinds, self.q, self.microbatches = kinds, q, microbatches
        self.choices = q.choices()
        self.pick: dict[int, list] = {}  # per rank: one boolean per choice, where there are several
        self.chosen: dict[tuple[int, str], object] = {}  # (chunk, key) -> its quantity under the rank's choice
        self.layers = len(kinds)
        self.chunks = pp * v
        self.runs = _runs(kinds)
        self.ranks: dict[int, list[int]] = {}
        for c in range(self.chunks):
            self.ranks.setdefault(chunk_rank(c), []).append(c)
        self.last_rank = chunk_rank(self.chunks - 1)

    def add_boundaries(self) -> None:
        """Boundary e_c (the first layer of chunk c) per chunk edge: 0 first, the layer count last, non-decreasing."""
        self.bound = [self.model.NewIntVar(0, self.layers, f"e{c}") for c in range(self.chunks + 1)]
        self.model.Add(self.bound[0] == 0)
        self.model.Add(self.bound[self.chunks] == self.layers)
        for c in range(self.chunks):
            self.model.Add(self.bound[c] <= self.bound[c + 1])

    def add_fixed_split(self, fixed: tuple[int, ...]) -> None:
        """Pins every boundary to the running total of the given layers per chunk."""
        acc = 0
        for c, n in enumerate(fixed):
            acc += n
            self.model.Add(self.bound[c + 1] == acc)

    def add_even_spread(self) -> None:
        """Each rank's chunks, in ``_spread``'s order, hold non-increasing layer counts at most
        one apart."""
        for cs in self.ranks.values():
            order = sorted(cs, key=lambda c: (c in (0, self.chunks - 1), c))
            size = [self.bound[c + 1] - self.bound[c] for c in order]
            for a, b in zip(size, size[1:]):
                self.model.Add(a >= b)
            if len(size) > 1:
                self.model.Add(size[-1] >= size[0] - 1)

    def add_clamps(self) -> None:
        """clamp(e - start, 0, len) per boundary and run, then each quantity's sum before every boundary."""
        layers, model = self.layers, self.model
        clamps = []
        for c, e in enumerate(self.bound):
            row = []
            for j, (_, start, length) in enumerate(self.runs):
                y = model.NewIntVar(0, length, f"y{c}_{j}")
                shifted = model.NewIntVar(-layers, layers, f"d{c}_{j}")
                model.Add(shifted == e - start)
                pos = model.NewIntVar(0, layers, f"p{c}_{j}")
                model.AddMaxEquality(pos, [shifted, 0])
                model.AddMinEquality(y, [pos, length])
                row.append(y)
            clamps.append(row)
        # per choice: key -> linear expression per boundary, the scaled sum over the layers before it
        self.prefixes = []
        for q in self.choices:
            prefix = {}
            for key in KEYS:
                coef = [round(getattr(q, key)[kind] * _SCALE[key]) for kind, _, _ in self.runs]
                prefix[key] = [sum(a * y for a, y in zip(coef, row)) for row in clamps]
            self.prefixes.append(prefix)
        self.prefix = self.prefixes[0]

    def add_choices(self) -> None:
        """Where ranks may choose among recompute sets (``Quantities.options``): one boolean per
        rank and choice, exactly one true, and per chunk and quantity that differs between the
        choices an integer equal to the chosen one's (``rank_total`` reads those)."""
        if len(self.choices) == 1:
            return
        # exposure as under the first choice (``_best_counts_choice`` says why): forward and
        # backward windows do not vary
        varying = [
            key
            for key in ("time", "act", "held")
            if any(
                [getattr(o, key), o.pre[key], o.post[key]] != [getattr(self.q, key), self.q.pre[key], self.q.post[key]]
                for o in self.choices
            )
        ]
        for r, cs in self.ranks.items():
            bools = self.pick[r] = [self.model.NewBoolVar(f"pick{r}_{i}") for i in range(len(self.choices))]
            self.model.AddExactlyOne(bools)
            for c in cs:
                for key in varying:
                    top = max(self._most(o, key) for o in self.choices)
                    y = self.chosen[(c, key)] = self.model.NewIntVar(0, top, f"q{c}_{key}")
                    for i, b in enumerate(bools):
                        expr = self.prefixes[i][key][c + 1] - self.prefixes[i][key][c] + self._extra(c, key, i)
                        self.model.Add(y == expr).OnlyEnforceIf(b)

    def _most(self, q: Quantities, key: str) -> int:
        """An upper bound on one chunk's scaled ``key`` under ``q``: every layer, both ends."""
        per = max(getattr(q, key)) * self.layers + q.pre[key] + q.post[key]
        return int(per * _SCALE[key]) + 2 * len(self.runs) + 2

    def add_maxima(self) -> None:
        """t_max and d_max, the slowest rank's time and exposed data-parallel time, up to a safe horizon."""
        self.horizon = max(
            int(sum(q.time) * US * self.layers + (q.pre["time"] + q.post["time"]) * US + q.p2p * US * self.chunks) + 1
            for q in self.choices
        )
        self.t_max = self.model.NewIntVar(0, self.horizon, "t_max")
        self.d_max = self.model.NewIntVar(0, self.horizon * max(1, self.microbatches), "d_max")

    def rank_total(self, cs: list[int], key: str):
        """Linear expression: one quantity summed over the chunks ``cs``, embedding and head
        included (under each rank's chosen recompute set, where ranks choose)."""
        return sum(
            self.chosen[(c, key)]
            if (c, key) in self.chosen
            else self.prefix[key][c + 1] - self.prefix[key][c] + self._extra(c, key)
            for c in cs
        )

    def _extra(self, c: int, key: str, choice: int = 0) -> int:
        """The embedding's and the head's share of a quantity on chunk c, scaled."""
        q, val = self.choices[choice], 0.0
        if c == 0:
            val += q.pre[key]
        if c == self.chunks - 1:
            val += q.post[key]
        return round(val * _SCALE[key])

    def add_rank_time(self, r: int, cs: list[int]) -> None:
        """t_max covers rank r's compute and a point-to-point send from each chunk but the last."""
        sends = len([c for c in cs if c < self.chunks - 1])
        self.model.Add(self.t_max >= self.rank_total(cs, "time") + round(self.q.p2p * US) * sends)

    def add_rank_memory(self, r: int, cs: list[int]) -> None:
        """Rank r's activations and model states fit beside its buffers at every moment of its
        order that can be its peak (one constraint per ``occupancy`` point)."""
        q = self.q
        states = self.rank_total(cs, "state")
        cap = int((q.capacity - q.buffers_of(r, self.last_rank)) / MEM_UNIT)
        chunks = sorted(cs)
        act = [self.rank_total([c], "act") + round(_boundary(q, c, self.chunks) * _SCALE["act"]) for c in chunks]
        held = [self.rank_total([c], "held") for c in chunks]
        grad = [self.rank_total([c], "grad") for c in chunks]
        for hs, ps, gs in q.occupancy[r]:
            load = sum(a * h for a, h in zip(act, hs) if h) + sum(b * p for b, p in zip(held, ps) if p)
            load += sum(x for x, g in zip(grad, gs) if g)
            self.model.Add(load + states <= cap)

    def add_rank_exposure(self, r: int, cs: list[int]) -> None:
        """d_max covers rank r's data-parallel time not hidden behind the compute it overlaps."""
        # gradient reduction after the last backward, parameter gather before the first forward,
        # ZeRO-3 traffic per micro-batch
        f_r, b_r = self.rank_total(cs, "fwd"), self.rank_total(cs, "bwd")
        exposed = []
        for lat_s, (traffic, window, times) in zip(
            self.q.dp_latency,
            (
                (self.rank_total(cs, "dp_time"), b_r, 1),
                (self.rank_total(cs, "dp_gather"), f_r, 1),
                (self.rank_total(cs, "dp_micro"), f_r + b_r, self.microbatches),
            ),
        ):
            if lat_s == 0:
                continue
            x = self.model.NewIntVar(0, self.horizon, "")
            self.model.Add(x >= traffic + round(lat_s * US) - window)
            if self.q.dp_share < 1:  # (1 - s) x traffic + s x (what shows) = shown + (1 - s) x hidden
                shown, x = x, self.model.NewIntVar(0, self.horizon, "")
                keep = round(SHARE_UNIT * self.q.dp_share)
                self.model.Add(SHARE_UNIT * x >= (SHARE_UNIT - keep) * (traffic + round(lat_s * US)) + keep * shown)
            exposed.append(x * times if times > 1 else x)
        self.model.Add(self.d_max >= sum(exposed))

    def set_objective(self) -> None:
        """Minimise the step: microbatches x the slowest rank's time, plus the largest exposure."""
        self.model.Minimize(self.microbatches * self.t_max + self.d_max)

    def solve(self, time_limit_s: float):
        """(solver, proved optimal) after a deterministic single-worker search, or None if nothing fits."""
        cp_model = self.cp_model
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.random_seed = 0
        status = solver.Solve(self.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return solver, status == cp_model.OPTIMAL

    def least_recompute(self, solver, optimal: bool, time_limit_s: float):
        """Among the splits and choices as good as the one found, one that spends the least
        time on the ranks in all (no rank recomputes more than the step needs); falls back to
        the first solution should the second search find nothing in time."""
        best = solver.Value(self.t_max) * self.microbatches + solver.Value(self.d_max)
        self.model.Add(self.microbatches * self.t_max + self.d_max <= best)
        for var in [*self.bound, *(b for bools in self.pick.values() for b in bools)]:
            self.model.AddHint(var, solver.Value(var))
        self.model.Minimize(sum(self.rank_total(cs, "time") for cs in self.ranks.values()))
        again = self.solve(time_limit_s)
        return (solver, optimal) if again is None else (again[0], optimal and again[1])

    def read_partition(self, solver, optimal: bool) -> Partition:
        """Layers per chunk from the solved boundaries and choices, with each rank's memory in bytes."""
        chunks = self.chunks
        cuts = [solver.Value(e) for e in self.bound]
        stage_layers = [cuts[c + 1] - cuts[c] for c in range(chunks)]
        picks = {r: next((i for i, b in enumerate(bools) if solver.Value(b)), 0) for r, bools in self.pick.items()}
        memory = [
            rank_memory(self.choices[picks.get(r, 0)], r, sorted(cs), self.kinds, stage_layers, self.last_rank)
            for r, cs in sorted(self.ranks.items())
        ]
        return Partition(
            stage_layers=stage_layers,
            t_max=solver.Value(self.t_max) / US,
            dp_exposed=solver.Value(self.d_max) / US,
            memory=memory,
            optimal=optimal,
            rank_option=[picks.get(r, 0) for r in sorted(self.ranks)],
        )


def _boundary(q: Quantities, c: int, chunks: int) -> float:
    """The output chunk ``c`` keeps per micro-batch in flight for its backward (none on the
    last chunk: its output is the loss)."""
    return q.boundary if c < chunks - 1 else 0.0


def chunk_loads(q: Quantities, kinds: list[int], stage_layers: list[int]) -> list[tuple[float, ...]]:
    """Per chunk of a split: (bytes kept per micro-batch in flight, bytes kept while waiting for
    the weight pass, model-state bytes but the gradients, gradient bytes), the embedding and head
    and the chunk's output included."""
    chunks, out, start = len(stage_layers), [], 0
    for c, n in enumerate(stage_layers):
        ends = ([q.pre] if c == 0 else []) + ([q.post] if c == chunks - 1 else [])
        mine = kinds[start : start + n]
        start += n
        act, held, state, grad = (
            sum(getattr(q, key)[k] for k in mine) + sum(e[key] for e in ends)
            for key in ("act", "held", "state", "grad")
        )
        out.append((act + _boundary(q, c, chunks), held, state, grad))
    return out


def rank_memory(q: Quantities, r: int, chunks: list[int], kinds: list[int], stage_layers: list[int], last: int):
    """Bytes rank ``r`` (holding ``chunks``) peaks at under a split: model states, buffers, and
    activations at the worst moment of its order."""
    loads = [chunk_loads(q, kinds, stage_layers)[c] for c in chunks]
    acts, helds, states, grads = zip(*loads)
    return peak(q.occupancy[r], acts, helds, grads) + sum(states) + q.buffers_of(r, last)


class _Layout:
    """What is fixed of a split before each rank's count of the remaining layers (all of
    ``kind``) is chosen: per chunk, the activation bytes it keeps in any case (embedding, head,
    its output, prefix layers of another kind); per rank, its chunks and those that may take the
    remaining layers (``open``)."""

    def __init__(self, q: Quantities, pp: int, chunks: int, chunk_rank, kind: int, prefix: dict, first_open: int):
        import numpy as np

        self.q, self.kind, self.chunks = q, kind, chunks
        self.last = chunk_rank(chunks - 1)
        self.fixed = np.zeros((3, chunks))  # per chunk: activation, waiting and gradient bytes
        for i, key in enumerate(("act", "held", "grad")):
            self.fixed[i, 0] += q.pre[key]
            self.fixed[i, chunks - 1] += q.post[key]
            for c, counts in prefix.items():
                self.fixed[i, c] += sum(n * getattr(q, key)[k] for k, n in counts.items())
        self.fixed[0, : chunks - 1] += q.boundary  # ``_boundary``: every chunk's output but the last's
        self.mine: list[list[int]] = [[] for _ in range(pp)]
        for c in range(chunks):
            self.mine[chunk_rank(c)].append(c)
        self.open = [[c for c in cs if c >= first_open] for cs in self.mine]
        self._ranks: dict[int, tuple] = {}
        # what ``fixed`` holds besides ``q``'s own (the same for every split of one prefix search)
        self._prefix = {c: tuple(sorted(counts.items())) for c, counts in prefix.items()}

    def rank_key(self, r: int) -> tuple:
        """What rank ``r``'s chunks hold of the prefix: with ``q`` and the chunks, all its fixed bytes
        depend on (``_per_rank_terms``' cache key)."""
        return tuple(self._prefix.get(c) for c in self.mine[r])

    def _rank(self, r: int) -> tuple:
        """Rank ``r``'s peak as a function of its chunks' layer counts: per point of its
        occupancy, the fixed bytes and the bytes per layer on each chunk; and the chunks (as
        positions among its own) in the order ``_rank_spread`` fills them."""
        import numpy as np

        hit = self._ranks.get(r)
        if hit is None:
            q, kind, mine = self.q, self.kind, self.mine[r]
            c = len(mine)
            rows = point_matrix(q.occupancy[r])
            base = rows @ self.fixed[:, mine].reshape(-1)
            scaled = rows * np.repeat([q.act[kind], q.held[kind], q.grad[kind]], c)
            slope = scaled[:, :c] + scaled[:, c : 2 * c] + scaled[:, 2 * c :]
            order = [mine.index(ch) for ch in _rank_spread(0, self.open[r], self.chunks)]
            hit = self._ranks[r] = (base, slope, tuple(order))
        return hit

    def memory(self, r: int, n: int, state: float) -> float:
        """Rank ``r``'s peak bytes holding ``n`` of the remaining layers beside ``state`` bytes of
        fixed model states."""
        return float(self.memories(r, n, state)[n])

    def memories(self, r: int, most: int, state: float):
        """``memory`` for every n from 0 to ``most``, as an array."""
        import numpy as np

        q = self.q
        base, slope, order = self._rank(r)
        peaks = (base[:, None] + slope @ _spread_table(slope.shape[1], order, most)).max(axis=0)
        return peaks + state + np.arange(most + 1) * q.state[self.kind] + q.buffers_of(r, self.last)


@lru_cache(maxsize=1024)
def _spread_table(chunks: int, order: tuple[int, ...], most: int):
    """Layers per chunk (rows) for every count n = 0..``most`` (columns) that ``_rank_spread``
    gives a rank of ``chunks`` chunks filling those at positions ``order`` in turn."""
    import numpy as np

    table = np.zeros((chunks, most + 1))
    if order:
        each, extra = np.divmod(np.arange(most + 1), len(order))
        table[list(order), :] = each[None, :] + (np.arange(len(order))[:, None] < extra[None, :])
    table.flags.writeable = False
    return table


def _per_rank_terms(
    layers, layout: _Layout, q: Quantities, pp, v, chunk_rank, microbatches, extras, closed, soft=False, cache=None
):
    """Per-rank functions of n (layers of ``layout.kind`` on the rank), in integer microseconds /
    bytes: the fixed time, the memory cap on n, and the exposed data-parallel time D(n).
    ``extras[r]`` adds fixed quantities to rank r (embedding, head, a prefix of other layers);
    ranks in ``closed`` take none of these layers. A rank whose fixed part alone does not fit
    makes it None, or with ``soft`` gets the cap -1 (another recompute set may fit there).
    ``cache``: a dict shared by calls with the same ``layers``, ``q``, ``v``, ``microbatches``,
    ``soft`` and head rank (``_solve_prefix``'s prefix splits): a rank's entry depends besides
    only on what its own chunks hold, so a split that changes other ranks reuses it."""
    ranks = []
    for r in range(pp):
        key = None
        if cache is not None:
            extra = tuple(extras[r][k] for k in KEYS)
            key = (r, layout.rank_key(r), tuple(layout.open[r]), r in closed, extra)
        entry = cache.get(key, False) if cache is not None else False
        if entry is False:  # not cached (None: cached as not fitting)
            entry = _rank_terms(layers, layout, q, r, v, microbatches, extras[r], r in closed, soft)
            if cache is not None:
                cache[key] = entry
        if entry is None:
            return None
        ranks.append(entry)
    return round(q.time[layout.kind] * US), ranks


def _rank_terms(layers, layout: _Layout, q: Quantities, r, v, microbatches, fixed, closed: bool, soft: bool):
    """``_per_rank_terms`` of rank ``r``: {const_t, cap, terms}, or None where its fixed part
    alone does not fit (and not ``soft``)."""
    kind = layout.kind
    sends = v - (1 if r == layout.last else 0)
    const_t = round((fixed["time"] + q.p2p * sends) * US)
    if q.capacity >= UNLIMITED:  # no memory limit: skip the peaks (most of the cost)
        cap = 0 if closed else layers
    else:
        memories = layout.memories(r, 0 if closed else layers, fixed["state"])
        if memories[0] > q.capacity and not soft:
            return None
        cap = int((memories <= q.capacity).sum()) - 1  # the most layers that fit: memory only grows with n
    f_per, b_per = round(q.fwd[kind] * US), round(q.bwd[kind] * US)
    f0, b0 = round(fixed["fwd"] * US), round(fixed["bwd"] * US)
    terms = []  # (slope, offset, multiplier) of max(0, slope * n + offset)
    for lat_s, key, times in zip(q.dp_latency, ("dp_time", "dp_gather", "dp_micro"), (1, 1, microbatches)):
        per = round(getattr(q, key)[kind] * US)
        extra = round((fixed[key] + lat_s) * US)
        if per == 0 and extra == 0:
            continue
        window_per, window0 = {"dp_time": (b_per, b0), "dp_gather": (f_per, f0)}.get(key, (f_per + b_per, f0 + b0))
        s = q.dp_share  # shown + (1 - s) x hidden = s x max(0, traffic - window) + (1 - s) x traffic
        if s < 1:
            terms.append((round((1 - s) * per), round((1 - s) * extra), times))
        terms.append(
            (per - window_per, extra - window0, times)
            if s == 1
            else (round(s * (per - window_per)), round(s * (extra - window0)), times)
        )
    return {"const_t": const_t, "cap": cap, "terms": terms}


def _exposed(terms, n: int) -> int:
    return sum(times * max(0, slope * n + offset) for slope, offset, times in terms)


def _base_extras(q: Quantities, pp: int, chunks: int, chunk_rank) -> list[dict]:
    first, last = chunk_rank(0), chunk_rank(chunks - 1)
    out = []
    for r in range(pp):
        out.append({k: (q.pre[k] if r == first else 0.0) + (q.post[k] if r == last else 0.0) for k in KEYS})
    return out


def _solve_per_rank(layers, q: Quantities, pp, v, chunk_rank, microbatches, time_limit_s) -> Partition | None:
    """All layers alike: only how many each rank holds is chosen (``_spread`` places them)."""
    chunks = pp * v
    if q.options:
        built = [
            (o, _base_extras(o, pp, chunks, chunk_rank), _Layout(o, pp, chunks, chunk_rank, 0, {}, 0))
            for o in q.choices()
        ]
        found = _best_counts_choice(layers, built, pp, v, chunk_rank, microbatches, set())
        return None if found is None else _chosen_partition(found, built, pp, chunks, chunk_rank, {}, 0)
    extras = _base_extras(q, pp, chunks, chunk_rank)
    layout = _Layout(q, pp, chunks, chunk_rank, 0, {}, 0)
    found = _best_counts(layers, layout, q, pp, v, chunk_rank, microbatches, extras, set())
    if found is None:
        return None
    value, t_max, d_max, counts = found
    stage_layers = _spread(counts, pp, chunks, chunk_rank, {})
    memory = [layout.memory(r, counts[r], extras[r]["state"]) for r in range(pp)]
    return Partition(stage_layers=stage_layers, t_max=t_max / US, dp_exposed=d_max / US, memory=memory, optimal=True)


def _solve_prefix(kinds, q: Quantities, pp, v, chunk_rank, microbatches) -> Partition | None:
    """A short run of one kind, then layers of another (DeepSeek-V3: 3 dense layers, then MoE).
    The prefix fills chunks 0..J in order (chunk J may also hold later layers, earlier ones may
    not), so every way of splitting it is enumerated; for each, the rest is the all-alike problem
    with the prefix's cost added to the ranks and chunks that hold it."""
    chunks = pp * v
    head_kind, rest_kind = kinds[0], kinds[-1]
    prefix = sum(1 for k in kinds if k == head_kind)
    rest = len(kinds) - prefix
    best = None
    last_chunk = [max(c for c in range(chunks) if chunk_rank(c) == r) for r in range(pp)]
    caches = [{} for _ in q.choices()]  # per choice: ``_per_rank_terms``'s ranks, shared by the splits
    for split in _compositions(prefix, min(chunks, prefix + 1)):
        j = len(split) - 1  # the last chunk holding prefix layers
        closed = {r for r in range(pp) if last_chunk[r] < j}
        built = []
        for o in q.choices():
            extras = _base_extras(o, pp, chunks, chunk_rank)
            for chunk, count in enumerate(split):
                for key in KEYS:
                    extras[chunk_rank(chunk)][key] += count * getattr(o, key)[head_kind]
            layout = _Layout(o, pp, chunks, chunk_rank, rest_kind, {c: {head_kind: n} for c, n in enumerate(split)}, j)
            built.append((o, extras, layout))
        # a split whose every time alone reaches the best objective so far cannot beat it
        if q.options:
            beat = None if best is None else best[0][0]
            found = _best_counts_choice(rest, built, pp, v, chunk_rank, microbatches, closed, caches, beat)
            if found is not None and (best is None or found[0] < best[0][0]):
                best = (found, built, split)
            continue
        _, extras, layout = built[0]
        beat = None if best is None else best[0]
        found = _best_counts(rest, layout, q, pp, v, chunk_rank, microbatches, extras, closed, caches[0], beat)
        if found is not None and (best is None or found[0] < best[0]):
            best = (*found, split, extras, layout)
    if best is None:
        return None
    if q.options:
        found, built, split = best
        return _chosen_partition(found, built, pp, chunks, chunk_rank, dict(enumerate(split)), len(split) - 1)
    _, t_max, d_max, counts, split, extras, layout = best
    stage_layers = _spread(counts, pp, chunks, chunk_rank, dict(enumerate(split)), first_open=len(split) - 1)
    memory = [layout.memory(r, counts[r], extras[r]["state"]) for r in range(pp)]
    return Partition(stage_layers=stage_layers, t_max=t_max / US, dp_exposed=d_max / US, memory=memory, optimal=True)


def _compositions(total: int, parts_max: int):
    """Ways to put ``total`` prefix layers into chunks 0..J (J < parts_max), the last one non-empty."""
    for parts in range(1, parts_max + 1):
        for cut in _weak(total, parts - 1):
            rest = total - sum(cut)
            if rest >= 1:
                yield (*cut, rest)


def _weak(total: int, parts: int):
    if parts == 0:
        yield ()
        return
    for first in range(total + 1):
        for tail in _weak(total - first, parts - 1):
            yield (first, *tail)


def _rank_spread(n: int, mine: list[int], chunks: int) -> dict[int, int]:
    """``n`` layers over the chunks ``mine`` of one rank: as even as whole layers allow, the
    extra ones to the earlier chunks, the embedding's and head's chunks (which carry those)
    last."""
    if not mine:
        return {}
    base, extra = divmod(n, len(mine))
    order = sorted(mine, key=lambda c: (c in (0, chunks - 1), c))
    return {c: base + (1 if i < extra else 0) for i, c in enumerate(order)}


def _spread(counts, pp, chunks, chunk_rank, prefix: dict, first_open: int = 0) -> list[int]:
    """Chunk sizes from per-rank counts (``_rank_spread`` over each rank's chunks from
    ``first_open`` on); ``prefix`` adds the prefix layers already placed per chunk."""
    stage_layers = [prefix.get(c, 0) for c in range(chunks)]
    for r in range(pp):
        mine = [c for c in range(chunks) if chunk_rank(c) == r and c >= first_open]
        for c, n in _rank_spread(counts[r], mine, chunks).items():
            stage_layers[c] += n
    return stage_layers


def _best_counts(layers, layout, q, pp, v, chunk_rank, microbatches, extras, closed, cache=None, beat=None):
    """Exact: the slowest rank's time can only be one of the values const_r + n * t; for each, in
    increasing order, the least data-parallel exposure with every rank under that time and within
    memory is found by bisection over the finitely many exposure values (each rank's exposure is
    convex in n, so the counts allowed under a bound form an interval). The scan stops once a
    larger time cannot pay for itself: microbatches x (T - T_first) >= the exposure at T_first.
    Returns (objective, t_max, d_max, counts) in microseconds, or None; None too where nothing
    is below ``beat`` (an objective found already, which the caller keeps on a tie)."""
    terms = _per_rank_terms(layers, layout, q, pp, v, chunk_rank, microbatches, extras, closed, cache=cache)
    if terms is None:
        return None
    t_layer, ranks = terms
    if sum(r["cap"] for r in ranks) < layers:
        return None
    times = sorted({r["const_t"] + n * t_layer for r in ranks for n in range(r["cap"] + 1)})

    def allowed(t_max: int) -> list[int]:
        if t_layer == 0:
            return [r["cap"] if t_max >= r["const_t"] else -1 for r in ranks]
        return [min(r["cap"], (t_max - r["const_t"]) // t_layer) if t_max >= r["const_t"] else -1 for r in ranks]

    lo, hi = 0, len(times) - 1
    if sum(max(0, a) for a in allowed(times[hi])) < layers:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(max(0, a) for a in allowed(times[mid])) >= layers:
            hi = mid
        else:
            lo = mid + 1
    best = None
    for t_max in times[lo:]:
        if best is not None and microbatches * t_max >= best[0] or beat is not None and microbatches * t_max >= beat:
            break
        tops = allowed(t_max)
        if any(top < 0 for top in tops):
            continue
        exposure = _least_exposure(ranks, tops, layers)
        if exposure is None:
            continue
        d_max, counts = exposure
        value = microbatches * t_max + d_max
        if best is None or value < best[0]:
            best = (value, t_max, d_max, counts)
    return best


def _chosen_partition(found, built, pp, chunks, chunk_rank, prefix: dict, first_open: int) -> Partition:
    """The Partition of ``_best_counts_choice``'s answer (``built``: per choice its quantities,
    per-rank extras and layout)."""
    _, t_max, d_max, counts, picks = found
    stage_layers = _spread(counts, pp, chunks, chunk_rank, prefix, first_open=first_open)
    memory = [built[picks[r]][2].memory(r, counts[r], built[picks[r]][1][r]["state"]) for r in range(pp)]
    return Partition(
        stage_layers=stage_layers,
        t_max=t_max / US,
        dp_exposed=d_max / US,
        memory=memory,
        optimal=True,
        rank_option=list(picks),
    )


def _best_counts_choice(layers, built, pp, v, chunk_rank, microbatches, closed, caches=None, beat=None):
    """``_best_counts`` where each rank also chooses its recompute set (``built``: per choice its
    quantities, per-rank extras and layout). Exact by the same scan: a rank's time under choice
    s is const_rs + n * t_s, so the slowest rank's time is one of those values; under a bound T
    a rank may take the counts 0..top_r, the most any choice allows it in time and memory.
    Exposure is weighed (and reported) as under the first choice: recomputing more lengthens a
    rank's backward, which could hide more data-parallel traffic, but also the fill and drain
    (``bubble``), which this objective leaves out; so no rank recomputes more but to fit or to
    shorten the slowest rank, each takes the quickest choice that allows its count, and the
    search's exposure bound under the first choice holds. Returns (objective, t_max, d_max,
    counts, choice per rank), or None (as for nothing below ``beat``: ``_best_counts``)."""
    terms = [
        _per_rank_terms(layers, layout, o, pp, v, chunk_rank, microbatches, extras, closed, True, cache)
        for (o, extras, layout), cache in zip(built, caches or [None] * len(built))
    ]
    options = [[(t, ranks[r]["const_t"], ranks[r]["cap"]) for t, ranks in terms] for r in range(pp)]
    if sum(max(0, max(cap for _, _, cap in opts)) for opts in options) < layers:
        return None
    times = sorted({const + n * t for opts in options for t, const, cap in opts for n in range(cap + 1)})

    def tops(t_max: int) -> list[list[int]]:
        return [
            [
                -1 if cap < 0 or t_max < const else cap if t == 0 else min(cap, (t_max - const) // t)
                for t, const, cap in opts
            ]
            for opts in options
        ]

    def allowed(t_max: int) -> list[int]:
        return [max(row) for row in tops(t_max)]

    lo, hi = 0, len(times) - 1
    if sum(max(0, a) for a in allowed(times[hi])) < layers:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if sum(max(0, a) for a in allowed(times[mid])) >= layers else (mid + 1, hi)
    base, best = terms[0][1], None
    for t_max in times[lo:]:
        if best is not None and microbatches * t_max >= best[0] or beat is not None and microbatches * t_max >= beat:
            break
        top = allowed(t_max)
        if any(x < 0 for x in top):
            continue
        exposure = _least_exposure(base, top, layers)
        if exposure is None:
            continue
        d_max, counts = exposure
        if best is None or microbatches * t_max + d_max < best[0]:
            best = (microbatches * t_max + d_max, t_max, d_max, counts)
    if best is None:
        return None
    value, t_max, d_max, counts = best
    rows = tops(t_max)
    picks = [
        min((s for s in range(len(opts)) if row[s] >= n), key=lambda s: (opts[s][1] + n * opts[s][0], s))
        for n, row, opts in zip(counts, rows, options)
    ]
    return value, t_max, d_max, counts, picks


def _least_exposure(ranks, tops: list[int], layers: int):
    """Smallest max_r D_r(n_r) with sum n_r = layers, 0 <= n_r <= tops[r], and counts achieving it."""
    values = [[_exposed(r["terms"], n) for n in range(top + 1)] for r, top in zip(ranks, tops)]
    candidates = sorted({x for vals in values for x in vals})

    def window(bound: int):
        lows, highs = [], []
        for vals in values:
            ok = [n for n, x in enumerate(vals) if x <= bound]
            if not ok:
                return None
            lows.append(ok[0])
            highs.append(ok[-1])
        return lows, highs

    lo, hi = 0, len(candidates) - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        w = window(candidates[mid])
        if w is not None and sum(w[0]) <= layers <= sum(w[1]):
            found = (candidates[mid], w)
            hi = mid - 1
        else:
            lo = mid + 1
    if found is None:
        return None
    d_max, (lows, highs) = found
    counts, short = list(lows), layers - sum(lows)
    for r in range(len(counts)):  # fill the earliest ranks first: deterministic
        take = min(short, highs[r] - lows[r])
        counts[r] += take
        short -= take
    return d_max, counts

"""Hardware profiles: TOML data files, one per machine (``cost_models/hardware/*.toml``).

Fields (all per GPU; GB = 1e9 bytes):

==================== ======== =====================================================================
``name``             str      profile name
``extends``          str      optional: another profile whose fields this one inherits
``peak_tflops``      table    dense peak TFLOP/s per dtype, e.g. ``{ bf16 = 989, fp8 = 1979 }``
``hbm_gb``           float    device memory, GB
``hbm_gbps``         float    device memory bandwidth, GB/s
``nvlink_gbps``      float    intra-node (NVLink) bandwidth per GPU per direction, GB/s
``nvlink_domain``    int      GPUs sharing one NVLink domain (8 for HGX, 72 for NVL72)
``network_gbps``     float    inter-node bandwidth per GPU per direction, GB/s
``wan_gbps``         float    optional (default 0: none): bandwidth per GPU per direction of the link
                              between islands (datacenters) DiLoCo training syncs over, GB/s: the
                              link's capacity divided by an island's GPUs (``cost_models.islands``)
``wan_latency_ms``   float    optional (default 0): per-step latency of a collective over that link, ms
``wan_island_gpus``  int      optional (default 0: one island): GPUs on each side of that link; a run
                              on more GPUs spans several islands, and compile may train it as
                              DiLoCo islands (``cost_models.islands.choose``)
``price_per_gpu_hour`` float  USD
``matmul_efficiency`` float   optional (default 0.8): best achievable share of peak for large GEMMs
``matmul_efficiency_fp8`` float optional (default: matmul_efficiency): the same for FP8 GEMMs
``attention_efficiency`` float optional (default 0.5): share of bf16 peak flash attention reaches
                              on long sequences (shorter ones are slower, see cost_models.compute)
``attention_backward`` float  optional (default 2.5): backward / forward time of the attention
                              kernel (flash attention reruns QK^T: 2.5x the forward's FLOPs)
``pointwise_efficiency`` float optional (default 1): share of ``hbm_gbps`` the memory-bound ops
                              (norms, activations, elementwise, the loss's softmax) reach; a CPU
                              core's bf16 and transcendental arithmetic keeps them well below its
                              copy bandwidth (``autoshard calibrate`` fits it on a reference model)
``attention_half_length`` float optional (default 180): key length at which the attention kernel
                              runs at half its long-sequence speed (``cost_models.compute``)
``attention_backward_half_length`` float optional (default: attention_half_length): the same for
                              its backward
``attention_score_ns`` float  optional (default 0): nanoseconds of the attention kernel's softmax
                              per score (query x key pair), beside its matmuls; a small head
                              dimension is slower per FLOP by it
``attention_backward_score_ns`` float optional (default 0): the same in its backward
``sm_count``         int      optional (default 132): streaming multiprocessors, for GEMM wave
                              quantisation (H100/H800/H200 132; DeepSeek-V3 §3.2.2 "20 of 132 SMs")
``link_efficiency``  float    optional (default 0.8): share of nvlink_gbps / network_gbps collectives
                              achieve (DeepSeek-V3 measured 160 of 200 GB/s on H800 NVLink)
``nvlink_latency_us`` float   optional (default 3): per-step latency of an NVLink collective, us
``network_latency_us`` float  optional (default 10): per-step latency of an inter-node collective, us
``overlap_slowdown`` float   optional (default 0.19): compute seconds lost per second of
                              communication running beside it (NCCL kernels take SMs and HBM
                              bandwidth; arXiv 2507.03114 measured 18.9% on average)
``memory_reserve_gb`` float   optional (default 6): HBM kept free for the allocator, CUDA context,
                              NCCL buffers and fragmentation
``op_overhead_us``   float    optional (default 0): host time per operation of the traced graph
                              that no roofline term counts (dispatch, autograd bookkeeping; the
                              backward counted as two operations per forward one). 0 on GPUs,
                              where kernels launch asynchronously ahead of the device; on CPUs each
                              op's dispatch runs in line with its arithmetic
``optimizer_bytes_per_param`` float optional (default 38): memory traffic of the optimizer step
                              per parameter a rank steps: the gradient norm it clips by reads the
                              fp32 gradient (4 B); the program's fused AdamW over fp32 masters
                              reads weight, gradient and both moments and writes weight and
                              moments (28 B), then rounds the master into the bf16 weight (6 B).
                              ``autoshard calibrate`` measures it (a CPU's per-tensor AdamW moves
                              more, and pays host time per tensor)
``checkpoint_op_overhead_us`` float optional (default 0): host time per op of a layer under
                              selective recomputation beyond the FLOPs it recomputes (the
                              checkpoint policy sees every op of the forward and of its replay);
                              0 on GPUs, where launches run ahead of the kernels
``fsdp_unit_overhead_us`` float optional (default 0): host time FSDP2 spends per unit (a layer)
                              per micro-batch at ZeRO-2/3 beyond its collectives (hooks, copies
                              in and out); 0 on GPUs, where the host runs ahead of the kernels
``blocking_wait_us``  float    optional (default 0): what a blocking collective (TP's, EP's
                              all-to-all) costs beyond its own time where the ranks on a host
                              outnumber its CPUs: the partner a rank waits for must first be given
                              a core (``autoshard calibrate`` measures it at its largest
                              ``--ranks``); counted only where ranks are time-sliced
``cores``            float    optional (default 0): how many one-thread ranks' worth of work one
                              host does at once (CPU runs, one thread per rank; ``autoshard
                              calibrate`` measures it, less than the CPU count where virtual CPUs
                              share a core or the memory bus); when more ranks than that run on a
                              host, each rank's compute, memory bandwidth and op overhead scale by
                              ranks / cores. 0: every rank has a device of its own (GPUs)
``oversubscribed_cores`` float optional (default 0: ``cores``): the work as many ranks as
                              ``autoshard calibrate``'s largest ``--ranks`` do together where they
                              outnumber the CPUs (rounded ``cores``): time-slicing costs each one
                              its caches, so it is less than ``cores``; ranks / this is the sharing
``memory_headroom``  float    optional (default 0): a further share of HBM a plan leaves free, for
                              what no tracker sees (the caching allocator's fragmentation grows
                              with the memory in use; CUDA-graph pools); ``compile --memory-headroom``
``collectives``      table    optional (default: none): measured figures per collective inside one
                              NVLink domain, ``{ all_reduce = { gbps = 1.2, latency_us = 90 }, ...}``
                              for ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
                              ``send``: ``gbps`` the bytes ``cost_models.comm``'s formula counts per
                              second (bus bandwidth, efficiency included) and ``latency_us`` its
                              per-step latency; a kind listed replaces ``nvlink_gbps`` x
                              ``link_efficiency`` and ``nvlink_latency_us`` for that collective
                              (``autoshard calibrate`` measures them)
``overlap``          table    optional (default 1 each): per kind of communication (``dp`` gradient
                              reduction and ZeRO gathers, ``tp`` collectives, ``cp`` ring, ``pp``
                              sends, ``ep`` all-to-all) the share of what the cost model would hide
                              behind compute that the emitted program really hides: 1 is the model's
                              overlap, 0 runs it all exposed (a program that waits on each
                              collective); ``autoshard calibrate`` measures them
==================== ======== =====================================================================

The efficiencies describe the program as it runs on GPUs: each layer compiled with
``torch.compile`` (regional compilation, the trainer's default there; ``--no-compile`` runs it
eagerly, which these figures do not describe), FlashAttention and the FP8 GEMMs as Triton
kernels. A layer under activation checkpointing runs eagerly either way.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from autoshard.errors import AutoshardError

PROFILE_DIR = Path(__file__).parent / "hardware"

_REQUIRED = {
    "name": str,
    "peak_tflops": dict,
    "hbm_gb": float,
    "hbm_gbps": float,
    "nvlink_gbps": float,
    "nvlink_domain": int,
    "network_gbps": float,
    "price_per_gpu_hour": float,
}
_OPTIONAL = {
    "matmul_efficiency": (float, 0.8),
    "matmul_efficiency_fp8": (float, None),
    "attention_efficiency": (float, 0.5),
    "attention_backward": (float, 2.5),
    "pointwise_efficiency": (float, 1.0),
    "attention_half_length": (float, 180.0),
    "attention_backward_half_length": (float, None),
    "attention_score_ns": (float, 0.0),
    "attention_backward_score_ns": (float, 0.0),
    "link_efficiency": (float, 0.8),
    "sm_count": (int, 132),
    "nvlink_latency_us": (float, 3.0),
    "network_latency_us": (float, 10.0),
    "memory_reserve_gb": (float, 6.0),
    "memory_headroom": (float, 0.0),
    "overlap_slowdown": (float, 0.19),
    "collectives": (dict, None),
    "overlap": (dict, None),
    "op_overhead_us": (float, 0.0),
    "checkpoint_op_overhead_us": (float, 0.0),
    "fsdp_unit_overhead_us": (float, 0.0),
    "blocking_wait_us": (float, 0.0),
    "cores": (float, 0.0),
    "oversubscribed_cores": (float, 0.0),
    "optimizer_bytes_per_param": (float, 38.0),
    "wan_gbps": (float, 0.0),
    "wan_latency_ms": (float, 0.0),
    "wan_island_gpus": (int, 0),
}

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
OVERLAP_KINDS = ("dp", "tp", "cp", "pp", "ep")

_MAY_BE_ZERO = (
    "wan_gbps",
    "wan_latency_ms",
    "wan_island_gpus",
    "price_per_gpu_hour",
    "memory_reserve_gb",
    "memory_headroom",
    "op_overhead_us",
    "checkpoint_op_overhead_us",
    "fsdp_unit_overhead_us",
    "blocking_wait_us",
    "cores",
    "oversubscribed_cores",
    "attention_half_length",
    "attention_backward_half_length",
    "attention_score_ns",
    "attention_backward_score_ns",
)
# fields that are a share of a peak (no kernel or link beats its peak)
_SHARES = (
    "matmul_efficiency",
    "matmul_efficiency_fp8",
    "attention_efficiency",
    "link_efficiency",
    "pointwise_efficiency",
)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict[str, float]
    hbm_gb: float
    hbm_gbps: float
    nvlink_gbps: float
    nvlink_domain: int
    network_gbps: float
    price_per_gpu_hour: float
    matmul_efficiency: float = 0.8
    matmul_efficiency_fp8: float | None = None
    attention_efficiency: float = 0.5
    attention_backward: float = 2.5
    pointwise_efficiency: float = 1.0
    attention_half_length: float = 180.0
    attention_backward_half_length: float | None = None
    attention_score_ns: float = 0.0
    attention_backward_score_ns: float = 0.0
    link_efficiency: float = 0.8
    sm_count: int = 132
    nvlink_latency_us: float = 3.0
    network_latency_us: float = 10.0
    memory_reserve_gb: float = 6.0
    memory_headroom: float = 0.0
    overlap_slowdown: float = 0.19
    collectives: dict[str, dict[str, float]] | None = None
    overlap: dict[str, float] | None = None
    op_overhead_us: float = 0.0
    checkpoint_op_overhead_us: float = 0.0
    fsdp_unit_overhead_us: float = 0.0
    blocking_wait_us: float = 0.0
    cores: float = 0.0
    oversubscribed_cores: float = 0.0
    optimizer_bytes_per_param: float = 38.0
    wan_gbps: float = 0.0  # the link between islands, per GPU per direction (0: the profile has none)
    wan_latency_ms: float = 0.0
    wan_island_gpus: int = 0  # GPUs on each side of it (0: one island)
    source: str = ""

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype``."""
        if dtype not in self.peak_tflops:
            raise AutoshardError(
                f"hardware {self.name!r} lists no peak for {dtype}; add it to peak_tflops in {self.source}"
            )
        return self.peak_tflops[dtype] * 1e12

    def link_rate(self, kind: str) -> float:
        """Bytes/s a ``kind`` collective (one of ``COLLECTIVES``) moves inside an NVLink domain:
        its measured figure where the profile lists one, else the NVLink rate at
        ``link_efficiency``."""
        if self.collectives and kind in self.collectives:
            return self.collectives[kind]["gbps"] * 1e9
        return self.nvlink_gbps * 1e9 * self.link_efficiency

    def link_latency_us(self, kind: str) -> float:
        """Microseconds per step of a ``kind`` collective inside an NVLink domain."""
        if self.collectives and kind in self.collectives:
            return self.collectives[kind]["latency_us"]
        return self.nvlink_latency_us

    def overlap_share(self, kind: str) -> float:
        """The share of what the cost model hides of ``kind`` (one of ``OVERLAP_KINDS``) that the
        emitted program hides on this machine (1 where the profile says nothing)."""
        return self.overlap.get(kind, 1.0) if self.overlap else 1.0

    def without_latency(self) -> Hardware:
        """This profile with every collective's per-step latency and the per-op overhead zero (the
        search's floor costs: what is left is linear in the tokens)."""
        table = {k: {**v, "latency_us": 0.0} for k, v in self.collectives.items()} if self.collectives else None
        return replace(
            self,
            nvlink_latency_us=0.0,
            network_latency_us=0.0,
            op_overhead_us=0.0,
            checkpoint_op_overhead_us=0.0,
            fsdp_unit_overhead_us=0.0,
            blocking_wait_us=0.0,
            collectives=table,
        )

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def usable_bytes(self) -> float:
        """What a plan may fill: HBM less the reserve and the headroom."""
        return (self.hbm_gb * (1 - self.memory_headroom) - self.memory_reserve_gb) * 1e9

    def memory_limit_text(self) -> str:
        """How ``usable_bytes`` is made, in words (plan.md states it)."""
        headroom = f" - {self.memory_headroom:.0%} headroom" if self.memory_headroom else ""
        return (
            f"{self.hbm_gb:g} GB HBM - {self.memory_reserve_gb:g} GB reserve{headroom} = "
            f"{self.usable_bytes / 1e9:.1f} GB a plan may fill"
        )

    def sharing(self, ranks: int) -> float:
        """How many ranks share one rank's compute when ``ranks`` run (``cores``): the ranks on
        one host (at most ``nvlink_domain``) over the work the host does at once, at least 1;
        where they outnumber its CPUs, over ``oversubscribed_cores``."""
        if not self.cores:
            return 1.0
        here = min(ranks, self.nvlink_domain)
        work = self.oversubscribed_cores if self.oversubscribed(ranks) and self.oversubscribed_cores else self.cores
        return max(1.0, here / work)

    def oversubscribed(self, ranks: int) -> bool:
        """Whether ``ranks`` ranks outnumber a host's CPUs (its rounded ``cores``): time-sliced."""
        return bool(self.cores) and min(ranks, self.nvlink_domain) > math.ceil(self.cores - 1e-9)

    def shared(self, ranks: int) -> Hardware:
        """This profile as one of ``ranks`` ranks sees its compute: peaks and memory bandwidth
        divided, op overhead and attention's time per score multiplied, by ``sharing`` (links
        unchanged); ``blocking_wait_us`` only where the ranks are time-sliced. Itself where
        nothing is shared."""
        share = self.sharing(ranks)
        wait = self.blocking_wait_us if self.oversubscribed(ranks) else 0.0
        if share == 1 and wait == self.blocking_wait_us:
            return self
        return replace(
            self,
            peak_tflops={k: v / share for k, v in self.peak_tflops.items()},
            hbm_gbps=self.hbm_gbps / share,
            op_overhead_us=self.op_overhead_us * share,
            checkpoint_op_overhead_us=self.checkpoint_op_overhead_us * share,
            fsdp_unit_overhead_us=self.fsdp_unit_overhead_us * share,
            attention_score_ns=self.attention_score_ns * share,
            attention_backward_score_ns=self.attention_backward_score_ns * share,
            blocking_wait_us=wait,
        )

    def to_dict(self) -> dict:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "source" and getattr(self, f.name) is not None
        }


def numeric(key: str) -> bool:
    """Whether ``key`` is a field of one number (not a table, not the name)."""
    kind = _REQUIRED.get(key) or _OPTIONAL.get(key, (None,))[0]
    return kind in (int, float)


def changed(profile: Hardware, changes: dict[str, float], where: str) -> Hardware:
    """``profile`` with ``changes`` (field -> number; ``peak_tflops.fp8`` for one entry of a
    table), checked as a profile file's fields are; errors name ``where`` for the file."""
    data = profile.to_dict()
    for key, value in changes.items():
        table, _, entry = key.partition(".")
        if entry:
            data[table] = {**(data.get(table) or {}), entry: value}
        else:
            data[key] = value
    return Hardware(**_validate(data, Path(where)), source=profile.source)


def known() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load(name_or_path: str) -> Hardware:
    """A profile by name (``h100``) or by path to a TOML file."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise AutoshardError(f"hardware profile not found: {name_or_path}")
    else:
        path = PROFILE_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            raise AutoshardError(
                f"unknown hardware {name_or_path!r}; known profiles: {', '.join(known())} "
                "(or pass a path to a .toml profile)"
            )
    return Hardware(**_resolve(path, set()), source=str(path))


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise AutoshardError(f"malformed TOML in {path}: {e}") from e


def _resolve(path: Path, seen: set[Path]) -> dict:
    if path.resolve() in seen:
        raise AutoshardError(f"{path}: 'extends' forms a cycle")
    seen.add(path.resolve())
    data = _read(path)
    base: dict = {}
    if "extends" in data:
        parent = data.pop("extends")
        if not isinstance(parent, str):
            raise AutoshardError(f"{path}: field 'extends' must be a profile name (a string)")
        parent_path = path.parent / f"{parent}.toml"
        if not parent_path.is_file():
            parent_path = PROFILE_DIR / f"{parent}.toml"
        if not parent_path.is_file():
            raise AutoshardError(f"{path}: extends unknown profile {parent!r}; known: {', '.join(known())}")
        base = _resolve(parent_path, seen)
    merged = {**base, **data}
    return _validate(merged, path)


def _validate(data: dict, path: Path) -> dict:
    allowed = set(_REQUIRED) | set(_OPTIONAL)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed fields: {', '.join(sorted(allowed))}"
            raise AutoshardError(f"{path}: unknown field {key!r}{hint}")
    out = {}
    for key, kind in _REQUIRED.items():
        if key not in data:
            raise AutoshardError(f"{path}: missing field {key!r}")
        out[key] = _typed(key, data[key], kind, path)
    for key, (kind, default) in _OPTIONAL.items():
        if key in data or default is not None:
            out[key] = _typed(key, data.get(key, default), kind, path)
    if out.get("matmul_efficiency_fp8") is None:
        out["matmul_efficiency_fp8"] = out["matmul_efficiency"]
    if not out["peak_tflops"]:
        raise AutoshardError(f"{path}: peak_tflops is empty; give at least one dtype, e.g. {{ bf16 = 989 }}")
    out["peak_tflops"] = {k: _typed(f"peak_tflops.{k}", v, float, path) for k, v in out["peak_tflops"].items()}
    if "collectives" in out:
        out["collectives"] = _collectives(out["collectives"], path)
    if "overlap" in out:
        out["overlap"] = _overlap(out["overlap"], path)
    return out


def _named_table(table: dict, names: tuple[str, ...], field: str, path: Path) -> None:
    for key in table:
        if key not in names:
            raise AutoshardError(f"{path}: {field} lists unknown kind {key!r}; known kinds: {', '.join(names)}")


def _collectives(table: dict, path: Path) -> dict[str, dict[str, float]]:
    """The ``collectives`` table: per kind a ``gbps`` above zero and a ``latency_us`` of zero or more."""
    _named_table(table, COLLECTIVES, "collectives", path)
    out = {}
    for kind, entry in table.items():
        if not isinstance(entry, dict) or set(entry) != {"gbps", "latency_us"}:
            raise AutoshardError(
                f"{path}: collectives.{kind} must be a table {{ gbps = ..., latency_us = ... }}, got {entry!r}"
            )
        out[kind] = {
            key: _typed(f"collectives.{kind}.{key}", entry[key], float, path) for key in ("gbps", "latency_us")
        }
    return out


def _overlap(table: dict, path: Path) -> dict[str, float]:
    """The ``overlap`` table: per kind a share in [0, 1]."""
    _named_table(table, OVERLAP_KINDS, "overlap", path)
    return {kind: _typed(f"overlap.{kind}", value, float, path) for kind, value in table.items()}


def _may_be_zero(key: str) -> bool:
    """Fields where zero means something (free, none kept, nothing hidden, no latency)."""
    return key in _MAY_BE_ZERO or key.startswith("overlap.") or key.endswith("latency_us")


def _typed(key: str, value, kind, path: Path):
    if kind is str:
        if not isinstance(value, str):
            raise AutoshardError(f"{path}: field {key!r} must be a string")
        return value
    if kind is dict:
        if not isinstance(value, dict):
            raise AutoshardError(f"{path}: field {key!r} must be a table like {{ bf16 = 989 }}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AutoshardError(f"{path}: field {key!r} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise AutoshardError(f"{path}: field {key!r} must be a finite number, got {value!r}")
    if kind is int and value != int(value):
        raise AutoshardError(f"{path}: field {key!r} must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not _may_be_zero(key)):
        raise AutoshardError(f"{path}: field {key!r} must be positive, got {value!r}")
    if (key in _SHARES or key.startswith("overlap.")) and value > 1:
        raise AutoshardError(f"{path}: field {key!r} is a share, at most 1 (0.8 is 80%), got {value!r}")
    if key == "memory_headroom" and value >= 1:
        raise AutoshardError(
            f"{path}: field 'memory_headroom' is a share of HBM below 1 (0.05 keeps 5% free), got {value!r}"
        )
    return kind(value)

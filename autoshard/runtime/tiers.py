"""Checkpoint tiers beyond the disk checkpoint, and slow ranks (the trainer's ``--snapshot-every``,
``--mirror-dir``, ``--straggler-factor``, ``--drop-stragglers``).

Tiers, LLaMA-3's way: host memory often, the local checkpoint directory less often, a remote
mirror rarely. A resumed run takes the newest tier complete for every rank
(``trainer.restore_newest_tier``).

- Host memory (:class:`HostSnapshots`). Under torchrun a failed rank restarts every worker
  process, so a copy in a worker's memory dies with it. The snapshot lives in tmpfs instead
  (``--snapshot-dir``, default ``/dev/shm``: host RAM that outlives the processes, not the node):
  each rank writes its own file of everything the disk checkpoint holds of it (its local tensors,
  not resharded: the same plan only), atomically (a temporary name, then a rename) and then its
  marker ``step_NNNNNNNN.rankRRRRR.complete`` with the file's size and CRC-32. A rank whose file
  is missing, short or damaged (its node was lost) cannot use it; the ranks agree on the newest
  step every rank holds intact, else none. The directory is keyed by the run: a token kept in the
  checkpoint directory (a new one when that directory is new) and the plan, so a new run in a new
  directory never takes an old run's snapshot. A run that ends normally removes its snapshots.
- Local disk: ``--checkpoint-dir`` (``durable``).
- Remote: ``--mirror-dir`` (:class:`Mirror`): every ``--mirror-every``-th disk checkpoint, once
  complete, is copied there by rank 0 in the background, into a hidden temporary directory with
  ``COMPLETE`` copied last, then renamed into place.

Slow ranks (:class:`Stragglers`): each rank's compute time per step is the time of its forward
and backward (``trainer.Progress``: from the step's start to the gradient reductions' wait;
CUDA events on GPUs), which excludes the waits in the data-parallel reductions, where in a
synchronous job every rank's wall time is the same. A rank whose compute time exceeds the
median of the other ranks' by ``--straggler-factor`` (the median of that ratio over the last
``--straggler-window`` steps) is named in a ``straggler`` event, with its host.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import statistics
import sys
import threading
import time
import zlib
from collections import deque
from pathlib import Path

import torch

from autoshard.runtime import durable

TOKEN = ".autoshard-run"  # in the checkpoint directory: which run it is
EXCLUDED = "excluded_hosts"  # in the checkpoint directory: hosts --drop-stragglers left out
SNAPSHOTS_KEPT = 2  # per rank: a rank whose newest write was cut short still shares the one before


def run_token(directory: Path) -> str:
    """The token of the run writing ``directory`` (made, once, by the first run there)."""
    path = Path(directory) / TOKEN
    if not path.is_file():
        tmp = path.with_name(f"{TOKEN}.{os.getpid()}.tmp")
        tmp.write_text(secrets.token_hex(8) + "\n")
        os.replace(tmp, path)
    return path.read_text().strip()


def snapshot_key(token: str, plan_sha256: str, world: int) -> str:
    return hashlib.sha256(f"{token} {plan_sha256} {world}".encode()).hexdigest()[:16]


class HostSnapshots:
    """This rank's snapshots in host memory (tmpfs) under ``root/autoshard-<key>``; one write in
    flight at a time, in a background thread (the tensors are copied to the host first)."""

    def __init__(self, root: Path, key: str, rank: int):
        self.directory = Path(root) / f"autoshard-{key}"
        self.rank = rank
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.write_s: list[float] = []  # per snapshot: serialising and writing, in the background
        self.bytes = 0  # the last snapshot's size
        self.directory.mkdir(parents=True, exist_ok=True)
        for tmp in self.directory.glob(f"*.rank{rank:05d}.*.tmp"):  # a write a kill cut short
            tmp.unlink(missing_ok=True)

    def _name(self, step: int, suffix: str) -> Path:
        return self.directory / f"step_{step:08d}.rank{self.rank:05d}.{suffix}"

    def save(self, step: int, payload: dict) -> None:
        """Write ``payload`` (tensors already copied to the host) as the snapshot after ``step``."""
        self.wait()
        self.thread = threading.Thread(target=self._write, args=(step, payload), daemon=True)
        self.thread.start()

    def _write(self, step: int, payload: dict) -> None:
        try:
            start = time.perf_counter()
            buf = io.BytesIO()
            torch.save(payload, buf)
            data = buf.getbuffer()
            tmp = self._name(step, f"pt.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self._name(step, "pt"))
            mark = self._name(step, f"complete.{os.getpid()}.tmp")
            mark.write_text(json.dumps({"step": step, "size": len(data), "crc32": f"{zlib.crc32(data):08x}"}))
            os.replace(mark, self._name(step, "complete"))  # last: the snapshot counts from here
            self.write_s.append(time.perf_counter() - start)
            self.bytes = len(data)
            for old in self.steps()[:-SNAPSHOTS_KEPT]:
                self._name(old, "complete").unlink(missing_ok=True)
                self._name(old, "pt").unlink(missing_ok=True)
        except BaseException as e:  # noqa: BLE001 - said by ``wait`` in the training thread
            self.error = e

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            e, self.error = self.error, None
            print(f"warning: host-memory snapshot in {self.directory} failed ({e}); disk checkpoints go on",
                  file=sys.stderr)  # fmt: skip

    def discard_from(self, step: int) -> None:
        """Remove this rank's snapshots of ``step`` and later."""
        self.wait()
        for s in self.steps():
            if s >= step:
                self._name(s, "complete").unlink(missing_ok=True)
                self._name(s, "pt").unlink(missing_ok=True)

    def steps(self) -> list[int]:
        """The steps this rank has a marker for, oldest first."""
        found = []
        for p in self.directory.glob(f"step_*.rank{self.rank:05d}.complete"):
            digits = p.name.split(".")[0].removeprefix("step_")
            if digits.isdigit():
                found.append(int(digits))
        return sorted(found)

    def intact(self) -> list[int]:
        """The steps whose file matches its marker (size and CRC-32)."""
        return [s for s in self.steps() if self._read(s) is not None]

    def _read(self, step: int) -> bytes | None:
        try:
            mark = json.loads(self._name(step, "complete").read_text())
            data = self._name(step, "pt").read_bytes()
        except (OSError, ValueError):
            return None
        ok = len(data) == mark.get("size") and f"{zlib.crc32(data):08x}" == mark.get("crc32")
        return data if ok else None

    def load(self, step: int) -> dict | None:
        data = self._read(step)
        return None if data is None else torch.load(io.BytesIO(data), weights_only=False)

    def remove(self) -> None:
        """This rank's snapshots (the run ended; its last disk checkpoint holds where it stands)."""
        self.wait()
        for p in self.directory.glob(f"step_*.rank{self.rank:05d}.*"):
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # the last rank out removes the directory


class Mirror:
    """Rank 0's copies of complete disk checkpoints in ``directory`` (the remote tier), made in a
    background thread, one at a time; ``keep`` as ``--keep``."""

    def __init__(self, directory: Path, keep: int | None):
        self.directory = Path(directory)
        self.keep = keep
        self.thread: threading.Thread | None = None
        self.done: list[dict] = []  # {"step", "mirror", "error"?} per copy, for the step log
        self.directory.mkdir(parents=True, exist_ok=True)
        for tmp in self.directory.glob(".incoming-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def copy(self, path: Path) -> None:
        self.wait()
        self.thread = threading.Thread(target=self._copy, args=(Path(path),), daemon=True)
        self.thread.start()

    def _copy(self, path: Path) -> None:
        target = self.directory / path.name
        tmp = self.directory / f".incoming-{path.name}-{os.getpid()}"
        try:
            shutil.copytree(path, tmp, ignore=shutil.ignore_patterns(durable.MARKER))
            shutil.copy2(path / durable.MARKER, tmp / durable.MARKER)  # last, as on disk
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
            if self.keep:
                for _, old in durable.checkpoints(self.directory)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
            self.done.append({"step": durable.step_of(path), "mirror": str(target)})
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            self.done.append({"step": durable.step_of(path), "mirror": str(target), "error": str(e)})

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class Stragglers:
    """Per-rank compute times per step, and the ranks that stay ``factor`` times above the other
    ranks' median over ``window`` steps: the median over the window of a rank's time divided by
    the others' median exceeds ``factor``, so that one step's noise neither names a rank nor
    clears it. Each is named once until it recovers."""

    def __init__(self, factor: float, window: int, hosts: list[str]):
        self.factor, self.window, self.hosts = factor, window, hosts
        self.ratios = [deque(maxlen=window) for _ in hosts]
        self.named: set[int] = set()

    def observe(self, step: int, compute_s: list[float]) -> list[dict]:
        """The step's per-rank compute times in; the ranks newly found slow out (as events)."""
        found = []
        if len(compute_s) < 2:
            return found
        medians = [statistics.median(compute_s[:r] + compute_s[r + 1 :]) for r in range(len(compute_s))]
        for r, (mine, median) in enumerate(zip(compute_s, medians)):
            self.ratios[r].append(mine / median if median > 0 else 1.0)
            slow = len(self.ratios[r]) == self.window and statistics.median(self.ratios[r]) > self.factor
            if slow and r not in self.named:
                found.append(
                    {"event": "straggler", "step": step, "rank": r, "host": self.hosts[r],
                     "factor": round(statistics.median(self.ratios[r]), 3), "threshold": self.factor,
                     "window": self.window, "compute_s": round(mine, 6),
                     "others_median_s": round(median, 6)}
                )  # fmt: skip
                self.named.add(r)
            elif not slow:
                self.named.discard(r)
        return found


def hostname() -> str:
    return socket.gethostname()


def record_excluded(directory: Path, host: str) -> None:
    """Add ``host`` to the checkpoint directory's ``excluded_hosts`` (one name a line)."""
    path = Path(directory) / EXCLUDED
    hosts = excluded(directory)
    if host not in hosts:
        tmp = path.with_name(f"{EXCLUDED}.{os.getpid()}.tmp")
        tmp.write_text("".join(f"{h}\n" for h in [*hosts, host]))
        os.replace(tmp, path)


def excluded(directory: Path) -> list[str]:
    path = Path(directory) / EXCLUDED
    return [h for h in path.read_text().split() if h] if path.is_file() else []

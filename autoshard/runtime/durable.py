"""Checkpoints on disk, defended: the directory layout, the marker, per-file checksums, a lock
against a second writer, and which checkpoint is intact.

``DIR/step_NNNNNNNN`` holds one checkpoint after that many optimizer steps: DCP's files
(``.metadata`` and one ``.distcp`` file or more per writing rank, RNG states included),
``trainer.json`` (where training stands, ``autoshard.runtime.trainer``), ``checksums.json`` (each
file's size and CRC-32) and, written last, ``COMPLETE``, which names the step and the checksum of
``checksums.json``. Only a directory with ``COMPLETE`` is a checkpoint; one whose files do not
match their checksums is damaged: the trainer sets it aside (``step_NNNNNNNN.damaged``) and
resumes from the newest intact one. A checkpoint a loss-spike rollback abandoned is set aside as
``step_NNNNNNNN.rolled-back``. Nothing here deletes a checkpoint but ``--keep``.

The ranks share the hashing: file ``i`` (sorted by name) is hashed by rank ``i mod world``, after
the write and before a load, so a rank reads about 1/world of a checkpoint's bytes either way (a
shared filesystem is what DCP's resharding load needs anyway). ``DIR/.autoshard.lock`` is held
(``flock``) by the run writing there; the kernel drops it when that process dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from autoshard.errors import ProgramError

MARKER = "COMPLETE"
SUMS = "checksums.json"
META = "trainer.json"
LOCK = ".autoshard.lock"
DAMAGED, ROLLED_BACK = "damaged", "rolled-back"


# ---------------------------------------------------------------------------------------------
# the layout


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory's name says (``step_NNNNNNNN``), else None (a set-aside one)."""
    name = Path(path).name
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory``, oldest first."""
    out = []
    for p in Path(directory).glob("step_*") if Path(directory).is_dir() else ():
        step = step_of(p)
        if step is not None and complete(p):
            out.append((step, p))
    return sorted(out)


def find(path: Path) -> Path | None:
    """The checkpoint ``path`` names: a complete checkpoint itself, or the newest complete one in
    the directory ``path``; None when there is none."""
    path = Path(path)
    if complete(path):
        return path
    found = checkpoints(path)
    return found[-1][1] if found else None


def is_checkpoint(path: Path) -> bool:
    """``path`` is one checkpoint (complete or not), not a directory of them."""
    path = Path(path)
    marked = any((path / n).exists() for n in (MARKER, META, ".metadata"))
    return path.is_dir() and (step_of(path) is not None or marked)


def remove_incomplete(directory: Path) -> list[Path]:
    """Directories a crash left without ``COMPLETE`` (rank 0, before training starts)."""
    gone = []
    for p in Path(directory).glob("step_*") if Path(directory).is_dir() else ():
        if p.is_dir() and step_of(p) is not None and not complete(p):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def set_aside(path: Path, why: str) -> Path:
    """Rename checkpoint ``path`` out of use (``step_NNNNNNNN.<why>``, numbered if taken); returns
    the new name. Its files stay for whoever wants to look."""
    path = Path(path)
    target = path.with_name(f"{path.name}.{why}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{why}.{n}")
    os.replace(path, target)
    return target


# ---------------------------------------------------------------------------------------------
# checksums


def file_sum(path: Path) -> list:
    """[size, CRC-32 as 8 hex digits] of a file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, f"{crc:08x}"]


def dcp_files(path: Path) -> list[str]:
    """The files DCP wrote for checkpoint ``path``: ``.metadata`` and the data files it names."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return sorted({".metadata", *(info.relative_path for info in (metadata.storage_data or {}).values())})


def _text_sum(text: str) -> list:
    data = text.encode()
    return [len(data), f"{zlib.crc32(data):08x}"]


def write_marker(path: Path, meta: dict, sums: dict) -> None:
    """``trainer.json``, then ``checksums.json`` (every file's, ``trainer.json``'s too), then
    ``COMPLETE`` naming the step and the checksum of ``checksums.json``, each durably."""
    text = json.dumps(meta, indent=2) + "\n"
    _write_durably(path / META, text)
    table = json.dumps({**sums, META: _text_sum(text)}, indent=1, sort_keys=True) + "\n"
    _write_durably(path / SUMS, table)
    size, crc = _text_sum(table)
    _write_durably(path / MARKER, f"{meta['step']}\n{SUMS} {size} {crc}\n")


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_sums(path: Path) -> dict | str:
    """The checkpoint's checksum table, after checking it against ``COMPLETE``; or why it cannot
    be trusted (a string). A checkpoint written before checksums has its DCP files listed with
    their sizes only (``None`` for the checksum), as its ``COMPLETE`` vouched."""
    path = Path(path)
    try:
        lines = (path / MARKER).read_text().splitlines()
    except OSError as e:
        return f"{MARKER} unreadable ({e.strerror or e})"
    if len(lines) < 2:  # the older marker: the step only
        try:
            from torch.distributed.checkpoint import FileSystemReader

            metadata = FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # noqa: BLE001 - any failure to read it is the damage
            return f".metadata unreadable ({_first_line(e)})"
        need: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        return {name: [length, None] for name, length in need.items()} | {META: [None, None]}
    parts = lines[1].split()
    if len(parts) != 3 or parts[0] != SUMS:
        return f"{MARKER} is malformed"
    try:
        actual = file_sum(path / SUMS)
    except OSError:
        return f"{SUMS} is missing"
    if actual != [int(parts[1]), parts[2]]:
        return f"{SUMS} does not match its checksum in {MARKER}"
    return json.loads((path / SUMS).read_text())


def check_file(path: Path, name: str, expected: list) -> str | None:
    """Why file ``name`` of checkpoint ``path`` is not as written, or None."""
    f = Path(path) / name
    if not f.is_file():
        return f"{name} is missing"
    size, crc = expected
    if crc is None:  # an older checkpoint: its size only (or, for trainer.json, that it parses)
        if size is None:
            try:
                json.loads(f.read_text())
            except (OSError, ValueError):
                return f"{name} is not readable JSON"
            return None
        return f"{name} is short" if f.stat().st_size < size else None
    actual = file_sum(f)
    if actual[0] != size:
        return f"{name} is {actual[0]} bytes, written as {size}"
    return f"{name} does not match its checksum" if actual[1] != crc else None


def damage(path: Path, group=None) -> str | None:
    """Why checkpoint ``path`` is damaged, or None when every file matches its checksum. With a
    process group, every rank of it calls this and checks its share of the files (the answer is
    the same on all); without one, this process checks them all."""
    distributed = group is not None or (dist.is_available() and dist.is_initialized())
    table = read_sums(path) if not distributed or dist.get_rank(group) == 0 else None
    if distributed:
        box = [table]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        table = box[0]
    if isinstance(table, str):
        return table
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    mine = None
    for i, name in enumerate(sorted(table)):
        if i % world == rank and (why := check_file(path, name, table[name])) is not None:
            mine = why
            break
    if not distributed:
        return mine
    found = [None] * world
    dist.all_gather_object(found, mine, group=group)
    return next((w for w in found if w), None)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


# ---------------------------------------------------------------------------------------------
# the directory: usable, and one writer


def unusable(directory: Path, need_bytes: float = 0.0) -> str | None:
    """Why checkpoints cannot be written to ``directory`` (made if missing), or None: not a
    directory, not writable (a probe file is written, synced and removed), or less free space
    than one checkpoint takes (``need_bytes``)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        return "it is a file, not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{socket.gethostname()}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        return f"it cannot be written ({e.strerror or e})"
    free = shutil.disk_usage(directory).free
    if need_bytes > free:
        return f"a checkpoint takes about {need_bytes / 1e9:.3g} GB and {free / 1e9:.3g} GB is free"
    return None


class DirectoryLock:
    """An exclusive ``flock`` on ``DIR/.autoshard.lock``, held while this process writes
    checkpoints there; the file names the holder (host, pid, since). The kernel releases the lock
    when the holder exits or dies, so a stale lock never blocks a restart."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK
        self.file = None

    def acquire(self) -> str | None:
        """None once held; else who holds it, in words."""
        import fcntl

        f = open(self.path, "a+")  # noqa: SIM115 - held open while the lock is
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return holder
        f.seek(0)
        f.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n")
        f.flush()
        self.file = f
        return None

    def release(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


# ---------------------------------------------------------------------------------------------
# writing


def finish(path: Path, meta: dict, keep: int | None, sums: dict, keep_previous: bool = False) -> None:
    """Rank 0, once every rank's files are written and hashed: ``trainer.json``, the checksums and
    ``COMPLETE``; then drop the complete checkpoints beyond the newest ``keep``, but with
    ``keep_previous`` never the newest one before this (where a loss spike seen in the next
    step rolls back to: this one may hold the update that caused it)."""
    write_marker(path, meta, sums)
    newest = meta["step"]
    if keep:
        done = checkpoints(path.parent)
        previous = max((s for s, _ in done if s < newest), default=None) if keep_previous else None
        for step, old in done[:-keep]:
            if step != previous:
                shutil.rmtree(old, ignore_errors=True)


class Checkpointer:
    """Writes checkpoints, asynchronously where it can: DCP's thread writes while training goes
    on, over a gloo group of its own (sharing the training group's gloo or NCCL communicator
    with a background thread collides with the step's collectives); a second gloo group carries
    the ranks' agreement that a write is done and their checksums. One write is in flight at a
    time. Every rank calls ``save``, ``poll`` and ``wait`` at the same points of the loop."""

    def __init__(self, directory: Path, keep: int | None, asynchronous: bool = True, keep_previous: bool = False):
        self.directory = Path(directory)
        self.keep = keep
        self.asynchronous = asynchronous
        self.keep_previous = keep_previous  # --keep never drops the one before the newest (``finish``)
        distributed = dist.is_initialized()
        self.group = dist.new_group(backend="gloo") if distributed else None
        self.sync = dist.new_group(backend="gloo") if distributed else None
        self.pending = None  # (future, path, meta, started, blocked)
        self.timings: list[dict] = []
        self.finished = None  # called with each checkpoint's path on rank 0 once it is complete

    def save(self, state: dict, meta: dict) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = step_dir(self.directory, meta["step"])
        started = time.perf_counter()
        if self.asynchronous:
            with _failing(path):
                future = dcp.async_save(
                    state, checkpoint_id=str(path), process_group=self.group, async_stager=_Staged()
                )
            future = getattr(future, "upload_completion", future)
            self.pending = (future, path, meta, started, time.perf_counter() - started)
        else:
            with _failing(path):
                dcp.save(state, checkpoint_id=str(path), process_group=self.group)
            self.pending = (None, path, meta, started, time.perf_counter() - started)
            self.poll()

    def _all_done(self, future) -> bool:
        done = future is None or future.done()
        if self.sync is None:
            return done
        flag = torch.tensor([int(done)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.sync)
        return bool(flag)

    def poll(self) -> None:
        """Finish the write in flight if every rank's part of it is done: the ranks hash the
        files between them, rank 0 writes the marker."""
        if self.pending is None:
            return
        future, path, meta, started, blocked = self.pending
        if not self._all_done(future):
            return
        self.pending = None
        if future is not None:
            with _failing(path):
                future.result()  # raises what the writer raised
        sums = self._sums(path)
        if self.sync is None or dist.get_rank(self.sync) == 0:
            finish(path, meta, self.keep, sums, self.keep_previous)
            if self.finished is not None:
                self.finished(path)
        self.timings.append({"step": meta["step"], "blocked_s": blocked, "write_s": time.perf_counter() - started})

    def _sums(self, path: Path) -> dict:
        if self.sync is None:
            return {name: file_sum(path / name) for name in dcp_files(path)}
        rank, world = dist.get_rank(self.sync), dist.get_world_size(self.sync)
        box = [dcp_files(path) if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.sync, 0), group=self.sync)
        mine = {name: file_sum(path / name) for i, name in enumerate(box[0]) if i % world == rank}
        every = [None] * world
        dist.all_gather_object(every, mine, group=self.sync)
        return {k: v for part in every for k, v in part.items()}

    def wait(self) -> None:
        if self.pending is not None and self.pending[0] is not None:
            with _failing(self.pending[1]):
                self.pending[0].result()
        self.poll()


@contextlib.contextmanager
def _failing(path: Path):
    """A checkpoint write that fails (a full disk, a lost mount) ends the run in one line: the
    checkpoints before it are intact, and the next start resumes from the newest of them."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        yield
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps the writer's OSError in its own
        failures = list(getattr(e, "failures", {}).values())  # DCP's: rank -> the exception (and its traceback)
        cause = failures[0][0] if failures and isinstance(failures[0], tuple) else failures[0] if failures else e
        raise ProgramError(
            f"writing checkpoint {path} failed ({type(cause).__name__}: {_first_line(cause)}); the checkpoints "
            "before it are intact: make room or fix the directory, and run again to resume from the newest"
        ) from None


class _Staged:
    """DCP's stager protocol for a state dict that is staged already: ``Pieces`` to save hold
    copies of the blocks, taken when the step ended, so the writer thread needs no second copy
    (and DCP's default stager cannot copy ``Pieces``)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

"""Token data for the training program: which token ids each step trains on.

Token files (``--data PATH``, one file or a directory of them):

* **header format** (what ``write_tokens`` and ``autoshard data prepare`` write): a 32-byte
  little-endian header, then the ids as little-endian unsigned integers::

      offset  size  field
      0       8     magic b"ASTOKENS"
      8       4     version (uint32, 1)
      12      4     bytes per id (uint32: 2 = uint16, 4 = uint32)
      16      8     token count (uint64)
      24      8     vocabulary size the ids were made for (uint64; 0 = not recorded)

* **headerless, with a sidecar** ``PATH.json`` holding ``{"dtype": "uint16" | "uint32" | "int32"}``:
  little-endian ids of that type from the first byte (nanoGPT's uint16 ``.bin`` files, say).
* **legacy**: a headerless file without a sidecar holds little-endian int32 ids.

A directory is read as one stream: its regular files sorted by name, except ``*.json`` sidecars
and hidden files (``.name``, where ``write_tokens`` keeps its temporary file). Files are
memory-mapped and only the windows a rank reads are touched.

Samples: the stream is cut into ``n = tokens // seq`` non-overlapping windows of ``seq`` tokens
(the tail is left out). Sample ``g`` (0, 1, 2, ...) is window ``(a * (g mod n) + b) mod n`` of
epoch ``g // n``, where ``a`` (coprime to ``n``) and ``b`` are drawn from a hash of (seed,
epoch): each epoch visits every window once, in an order that depends only on the seed and the
sample's index, never on the data-parallel size, the micro-batching or restarts, and needs no
permutation array however long the stream. The batch at data position ``index`` with ``batch``
rows is samples ``[index * batch, (index + 1) * batch)``.

Without ``--data`` the tokens are synthetic: uniform ids from a generator seeded by (seed, index).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from autoshard.errors import ProgramError

MAGIC = b"ASTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, bytes per id, token count, vocabulary size
HEADER_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # bytes per id -> dtype of the header format
SIDECAR_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4"), "int32": np.dtype("<i4")}
LEGACY_DTYPE = np.dtype("<i4")


def _error(message: str) -> ProgramError:
    return ProgramError(message)


# ---------------------------------------------------------------------------------------------
# writing


def id_dtype(vocab: int) -> np.dtype:
    """The narrowest id type of the header format for a vocabulary of ``vocab`` ids."""
    return HEADER_DTYPES[2] if vocab <= 1 << 16 else HEADER_DTYPES[4]


def write_tokens(path: str | os.PathLike, ids: np.ndarray, vocab: int) -> str:
    """Write ``ids`` (1-D, in ``[0, vocab)``) to ``path`` in the header format, uint16 when the
    vocabulary fits and uint32 otherwise (``vocab`` 0: not recorded; the type then fits the largest
    id). Atomic: a hidden temporary file beside ``path`` is renamed over it. Returns the id type's
    name."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"write_tokens: expected a 1-D array of integer ids, got {ids.dtype} of shape {ids.shape}")
    if not 0 <= vocab <= 1 << 32:
        raise ValueError(f"write_tokens: vocabulary size {vocab} does not fit uint32 ids")
    low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, -1)
    if low < 0 or (vocab and high >= vocab) or high >= 1 << 32:
        raise ValueError(f"write_tokens: ids span [{low}, {high}], outside [0, {vocab or 1 << 32})")
    dtype = id_dtype(vocab or high + 1)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, ids.size, vocab))
            f.write(np.ascontiguousarray(ids, dtype=dtype).data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return "uint16" if dtype.itemsize == 2 else "uint32"


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class TokenFile:
    """One file's ids: where they start, their type and count, the vocabulary its header records."""

    path: Path
    offset: int  # bytes before the first id
    dtype: np.dtype
    count: int
    vocab: int  # 0: not recorded
    legacy: bool  # headerless without a sidecar: read as int32
    _ids: np.memmap | None = field(default=None, repr=False)

    @property
    def ids(self) -> np.memmap:
        """The ids, memory-mapped on first use (a directory of many files keeps few maps open)."""
        if self._ids is None:
            self._ids = np.memmap(self.path, self.dtype, mode="r", offset=self.offset, shape=(self.count,))
        return self._ids


def open_file(path: Path) -> TokenFile:
    """The layout of one token file, from its header, its sidecar or the legacy format."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    sidecar = path.with_name(path.name + ".json")
    if head[: len(MAGIC)] == MAGIC:
        if sidecar.exists():
            raise _error(f"--data {path} has a token-file header and a sidecar {sidecar}; delete the sidecar")
        return _from_header(path, head, size)
    if sidecar.exists():
        dtype = _sidecar_dtype(sidecar)
        return TokenFile(path, 0, dtype, _whole_ids(path, size, dtype, f"as {sidecar} says"), 0, False)
    hint = "as a headerless file without a sidecar PATH.json"
    return TokenFile(path, 0, LEGACY_DTYPE, _whole_ids(path, size, LEGACY_DTYPE, hint), 0, True)


def _from_header(path: Path, head: bytes, size: int) -> TokenFile:
    fix = "rewrite it with autoshard data prepare"
    if len(head) < HEADER.size:
        raise _error(f"--data {path}: bad header ({len(head)} bytes, the header has {HEADER.size}); {fix}")
    _, version, width, count, vocab = HEADER.unpack(head)
    if version != VERSION:
        raise _error(f"--data {path}: bad header (version {version}; this program reads version {VERSION}); {fix}")
    if width not in HEADER_DTYPES:
        raise _error(f"--data {path}: bad header ({width} bytes per id; 2 or 4 expected); {fix}")
    if size != HEADER.size + count * width:
        raise _error(
            f"--data {path}: bad header ({count} ids of {width} bytes need {HEADER.size + count * width} bytes, "
            f"the file has {size}: truncated?); {fix}"
        )
    return TokenFile(path, HEADER.size, HEADER_DTYPES[width], count, vocab, False)


def _sidecar_dtype(sidecar: Path) -> np.dtype:
    try:
        dtype = json.loads(sidecar.read_text()).get("dtype")
    except (ValueError, AttributeError):
        dtype = None
    if not isinstance(dtype, str) or dtype not in SIDECAR_DTYPES:
        raise _error(f'{sidecar}: expected {{"dtype": "uint16" | "uint32" | "int32"}}, got {dtype!r}')
    return SIDECAR_DTYPES[dtype]


def _whole_ids(path: Path, size: int, dtype: np.dtype, how: str) -> int:
    if size % dtype.itemsize:
        raise _error(
            f"--data {path}: {size} bytes is not a whole number of {dtype.name} ids ({how}); "
            f'describe it with {path.name}.json ({{"dtype": "uint16"}}, say) or use autoshard data prepare'
        )
    return size // dtype.itemsize


@dataclass
class Stream:
    """The token files of ``--data`` read as one stream."""

    files: list[TokenFile]
    starts: list[int]  # each file's first token in the stream
    tokens: int
    widest: TokenFile | None  # the file whose header records the largest vocabulary

    @classmethod
    def open(cls, path: Path) -> Stream:
        if path.is_dir():
            names = sorted(p for p in path.iterdir() if p.is_file() and not _skipped(p.name))
            if not names:
                raise _error(f"--data {path}: the directory holds no token files (autoshard data prepare writes one)")
        elif path.is_file():
            names = [path]
        else:
            raise _error(f"--data {path}: not a file or a directory")
        files = [f for f in map(open_file, names) if f.count]  # an empty file adds nothing to the stream
        starts = np.cumsum([0] + [f.count for f in files]).tolist()
        return cls(files, starts[:-1], starts[-1], max(files, key=lambda f: f.vocab, default=None))

    def read(self, start: int, count: int) -> list[tuple[TokenFile, np.ndarray]]:
        """Tokens ``[start, start + count)`` of the stream, as pieces of the files holding them."""
        pieces = []
        i = bisect.bisect_right(self.starts, start) - 1
        while count:
            f = self.files[i]
            lo = start - self.starts[i]
            hi = min(f.count, lo + count)
            pieces.append((f, f.ids[lo:hi]))
            count -= hi - lo
            start += hi - lo
            i += 1
        return pieces


def _skipped(name: str) -> bool:
    return name.startswith(".") or name.endswith(".json")


_STREAMS: dict[Path, tuple[tuple[int, int], Stream]] = {}


def stream(data: str | os.PathLike) -> Stream:
    """The stream of ``data``, opened once: cached by resolved path, reopened when the path's
    modification time or size changes (a file rewritten, a file added to the directory)."""
    path = Path(data).resolve()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _error(f"--data {data}: no such file or directory") from None
    signature = (st.st_mtime_ns, st.st_size)
    cached = _STREAMS.get(path)
    if cached is None or cached[0] != signature:
        cached = _STREAMS[path] = (signature, Stream.open(path))
    return cached[1]


def window(sample: int, windows: int, seed: int) -> int:
    """The window sample ``sample`` reads among ``windows``: an affine bijection of the sample's
    place in its epoch, drawn from (seed, epoch)."""
    epoch, place = divmod(sample, windows)
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=16).digest()
    a, b = int.from_bytes(digest[:8], "little") % windows, int.from_bytes(digest[8:], "little") % windows
    while math.gcd(a, windows) != 1:  # a multiplier coprime to the window count makes a bijection
        a = (a + 1) % windows
    return (a * place + b) % windows


# ---------------------------------------------------------------------------------------------
# batches


def batch_rows(
    index: int, batch: int, seq: int, vocab: int, seed: int, data: str | os.PathLike | None, start: int, stop: int
) -> torch.Tensor:
    """Rows ``start:stop`` of the batch at data position ``index`` (a LongTensor (stop - start,
    seq)): what one data-parallel rank reads; only those rows' windows are touched. The ids are
    checked against the model's vocabulary ``vocab``."""
    if not 0 <= start <= stop <= batch:
        raise ValueError(f"rows {start}:{stop} are not rows of a batch of {batch}")
    if data is None:  # synthetic: the whole batch is drawn so that any rows of it agree
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        return torch.randint(0, vocab, (batch, seq), generator=gen)[start:stop]
    s, windows = _opened(data, seq, vocab)
    rows = []
    for g in range(index * batch + start, index * batch + stop):
        pieces = s.read(window(g, windows, seed) * seq, seq)
        for f, ids in pieces:
            _check_ids(f, ids, vocab)
        rows.append(np.concatenate([ids for _, ids in pieces]).astype(np.int64))
    return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, seq, dtype=torch.long)


def _opened(data: str | os.PathLike, seq: int, vocab: int) -> tuple[Stream, int]:
    """The stream of ``data`` and its windows of ``seq`` tokens, once it holds one and was not
    tokenised for a larger vocabulary than the model's."""
    s = stream(data)
    windows = s.tokens // seq
    if not windows:
        raise _error(f"--data {data}: {s.tokens} tokens, fewer than one sequence of {seq}")
    if s.widest.vocab > vocab:
        raise _error(
            f"--data {s.widest.path} was tokenised for a vocabulary of {s.widest.vocab} ids but the model has "
            f"{vocab}; tokenise with the model's tokenizer (autoshard data prepare --tokenizer ...)"
        )
    return s, windows


def _check_ids(f: TokenFile, ids: np.ndarray, vocab: int) -> None:
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < vocab:
        return
    bad = low if low < 0 else high
    hint = (
        f'; if it holds uint16 ids (nanoGPT), describe it with {f.path.name}.json {{"dtype": "uint16"}}'
        if f.legacy
        else ""
    )
    raise _error(
        f"--data {f.path}: token id {bad} is outside the model's vocabulary [0, {vocab}); tokenise with the "
        f"model's tokenizer (autoshard data prepare --tokenizer ...){hint}"
    )


SCAN_IDS = 1 << 26  # ids per chunk when a file's ids are scanned at start


def check(data: str | os.PathLike, batch: int, seq: int, vocab: int, steps: int) -> list[str]:
    """Before the first step: the data can feed this run, or a one-line error. A file whose
    header records a vocabulary no larger than the model's was checked id by id when it was
    written (``write_tokens``); the others (sidecar and raw files, headers without a vocabulary)
    have their ids scanned now, so that an id outside the vocabulary stops the run at its start
    rather than at the step that reads it. Returns warnings: fewer sequences than one global
    batch (every batch repeats windows), or more reads than the data holds."""
    s, windows = _opened(data, seq, vocab)
    for f in s.files:
        if f.vocab and not f.legacy:
            continue
        for start in range(0, f.count, SCAN_IDS):
            _check_ids(f, np.asarray(f.ids[start : start + SCAN_IDS]), vocab)
    notes = []
    if windows < batch:
        notes.append(
            f"--data {data} holds {windows} sequences of {seq} tokens, fewer than one global batch of {batch}: "
            "every batch repeats some of them"
        )
    elif steps * batch > windows:
        notes.append(
            f"--data {data} holds {windows} sequences of {seq} tokens; {steps} steps of {batch} read it "
            f"{steps * batch / windows:.1f} times over"
        )
    return notes


def global_batch(
    index: int, batch: int, seq: int, vocab: int, seed: int, data: str | os.PathLike | None = None
) -> torch.Tensor:
    """The whole batch at data position ``index`` (LongTensor (batch, seq)), the same on every
    rank: synthetic tokens seeded by (seed, index) without ``data``, else samples ``[index *
    batch, (index + 1) * batch)`` of the token stream."""
    return batch_rows(index, batch, seq, vocab, seed, data, 0, batch)

"""``autoshard data prepare``: text files tokenised into one token file for ``train.py --data``
(the header format of ``autoshard.runtime.data``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from autoshard.errors import AutoshardError, check_output_file
from autoshard.runtime.data import id_dtype, write_tokens

LINES_PER_CALL = 1024  # documents tokenised per tokenizer call with --split-lines


def prepare(
    texts: list[str | Path],
    tokenizer: str,
    out: str | Path,
    append_eos: bool = True,
    split_lines: bool = False,
) -> dict:
    """Tokenise ``texts`` with ``AutoTokenizer.from_pretrained(tokenizer)`` (a hub name or a local
    directory) and write the ids to ``out``: each file is one document (each non-blank line with
    ``split_lines``), followed by the tokenizer's EOS token unless ``append_eos`` is false.
    Returns the summary: files, documents, tokens, dtype, vocab, seconds, out."""
    start = time.perf_counter()
    paths = [Path(t) for t in texts]
    for path in paths:
        if not path.is_file():
            raise AutoshardError(f"{path}: no such text file")
    check_output_file(out)  # before the tokenising, not after it
    tok = _load(tokenizer)
    eos = tok.eos_token_id
    if append_eos and eos is None:
        raise AutoshardError(f"tokenizer {tokenizer} has no EOS token; pass --no-eos to join documents without one")
    vocab = len(tok)  # added tokens included
    dtype = id_dtype(vocab)
    pieces, documents = [], 0
    for path in paths:
        batches = _line_batches(path) if split_lines else [[_read(path)]]
        for docs in batches:
            encoded = tok(docs, add_special_tokens=False, verbose=False)["input_ids"]
            pieces.append(np.asarray([i for ids in encoded for i in (ids + [eos] if append_eos else ids)], dtype))
            documents += len(encoded)
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    written = write_tokens(out, ids, vocab)
    seconds = time.perf_counter() - start
    return {
        "files": len(paths),
        "documents": documents,
        "tokens": int(ids.size),
        "dtype": written,
        "vocab": vocab,
        "seconds": seconds,
        "out": str(out),
    }


def _load(name: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise AutoshardError("autoshard data prepare needs transformers: pip install transformers") from None
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a tokenizer it cannot load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AutoshardError(
            f"--tokenizer {name}: cannot load the tokenizer ({first}); pass a hub name or a directory "
            "holding tokenizer.json / tokenizer_config.json"
        ) from None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise AutoshardError(f"{path}: not UTF-8 text; convert it to UTF-8") from None


def _line_batches(path: Path) -> Iterator[list[str]]:
    """The file's non-blank lines (without their line ends), ``LINES_PER_CALL`` at a time, read
    as they are needed."""
    batch = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    batch.append(line.rstrip("\r\n"))
                if len(batch) == LINES_PER_CALL:
                    yield batch
                    batch = []
    except UnicodeDecodeError:
        raise AutoshardError(f"{path}: not UTF-8 text; convert it to UTF-8") from None
    if batch:
        yield batch

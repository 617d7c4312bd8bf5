"""A model's trained weights, read piece by piece: what ``--init-from`` starts a program from.

``open_weights`` takes a ``.safetensors`` file, a ``torch.save``'d state dict (``.pt``, ``.pth``,
``.bin``; also one wrapped under ``"state_dict"`` or ``"model"``), or a directory as transformers'
``save_pretrained`` writes it (``model.safetensors``, ``pytorch_model.bin``, or either split into
shards by an ``.index.json`` whose ``weight_map`` names each tensor's file). The names in the files
are the single-device model's state-dict keys; a stage names the same tensor ``model.<key>``.

A rank reads only its pieces: ``Weights.read`` takes the blocks ``stages.piece_blocks`` gives and
reads just those, from safetensors slices or from a state dict mapped into memory, so a rank's
reads add up to its share of the model, never the whole of it. Files are opened on first use and
kept open.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from autoshard.errors import ProgramError
from autoshard.ir.program import Tied
from autoshard.runtime.stages import Block

# what a directory may hold, in the order they are looked for (transformers' file names)
DIRECTORY_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_UNREADABLE = (OSError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError, SafetensorError)


class _Safetensors:
    """One safetensors file: its header read at opening, tensors read slice by slice."""

    def __init__(self, path: Path):
        self.file = safe_open(str(path), framework="pt", device="cpu")

    def keys(self) -> list[str]:
        return list(self.file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.file.get_slice(name).get_shape())

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.file.get_slice(name)[index]


class _TorchFile:
    """One ``torch.save``'d state dict, mapped into memory: slicing a tensor reads its pages only."""

    def __init__(self, path: Path):
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(state, dict):
            inner = next((state[k] for k in ("state_dict", "model") if isinstance(state.get(k), dict)), state)
            state = {k: v for k, v in inner.items() if isinstance(v, torch.Tensor)}
        if not isinstance(state, dict) or not state:
            raise ValueError("it holds no state dict of tensors")
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.state[name][index]


def _open_file(path: Path) -> _Safetensors | _TorchFile:
    kind = "safetensors" if path.suffix == ".safetensors" else "a torch.save'd state dict"
    try:
        return _Safetensors(path) if path.suffix == ".safetensors" else _TorchFile(path)
    except _UNREADABLE as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ProgramError(f"{path}: cannot read it as {kind}: {first}") from None


class Weights:
    """A checkpoint's tensors by name (the single-device model's state-dict keys), each in one
    file of the checkpoint, opened on first use and kept open."""

    def __init__(self, path: Path, files: dict[str, Path], opened: dict[Path, object] | None = None):
        self.path = path  # what was opened: a file, or a shard index
        self._files = files  # name -> the file holding it
        self._open = dict(opened or {})

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The full (single-device) shape of tensor ``name``."""
        return self._reader(name).shape(name)

    def read(self, name: str, blocks: list[Block], piece_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A piece of tensor ``name`` of ``piece_shape``, cast to ``dtype``, made of ``blocks``
        (``stages.piece_blocks``): only they are read from the file."""
        reader = self._reader(name)
        piece = torch.empty(piece_shape, dtype=dtype)
        for b in blocks:
            source = tuple(slice(start, start + n) for start, n in zip(b.full, b.sizes))
            target = tuple(slice(start, start + n) for start, n in zip(b.local, b.sizes))
            value = reader.block(name, source)
            if dtype.is_floating_point and not value.is_floating_point():
                raise ProgramError(
                    f"{self.path}: {name} is {value.dtype}, where the program holds a {dtype} parameter; a cast "
                    "would change it silently: give a file of this model's floating-point weights"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ProgramError(
                    f"{self.path}: {name} holds values that are not finite (nan or inf), so every loss would be; "
                    "give weights saved before they went bad"
                )
            piece[target] = value
        return piece

    def find(self, source: str, tied: Sequence[Tied] = ()) -> str | None:
        """The name in the checkpoint of a stage's ``source`` (``model.<key>``), or of a name
        ``tied`` (the program's ties, ``Program.tied``) to it: transformers saves a tied output
        head once, under the embedding's name. None if the checkpoint holds neither."""
        equivalent = [n for entry in tied if source in entry.names for n in entry.names if n != source]
        for name in (source, *equivalent):
            key = name.removeprefix("model.")
            if key in self._files:
                return key
        return None

    def _reader(self, name: str):
        file = self._files[name]
        if file not in self._open:
            self._open[file] = _open_file(file)
        return self._open[file]


def open_weights(path: str | Path) -> Weights:
    """The checkpoint at ``path``: a safetensors or torch file, a transformers shard index, or a
    directory holding one of ``DIRECTORY_FILES``. Reads headers (a torch file is mapped, not
    read); raises ``ProgramError`` with one line where ``path`` is none of those."""
    path = Path(path)
    if path.is_dir():
        found = next((path / n for n in DIRECTORY_FILES if (path / n).is_file()), None)
        if found is None:
            raise ProgramError(
                f"{path} holds none of {', '.join(DIRECTORY_FILES)}: pass a directory written by "
                "save_pretrained, or a .safetensors or torch.save'd state dict file"
            )
        path = found
    if not path.is_file():
        raise ProgramError(f"{path}: no such weights file or directory")
    if path.name.endswith(".index.json"):
        return _open_index(path)
    if path.suffix != ".safetensors" and path.suffix not in TORCH_SUFFIXES:
        raise ProgramError(
            f"{path}: not a weights file; expected .safetensors, {', '.join(TORCH_SUFFIXES)}, "
            "a .index.json or a save_pretrained directory"
        )
    reader = _open_file(path)
    return Weights(path, dict.fromkeys(reader.keys(), path), {path: reader})


def _open_index(path: Path) -> Weights:
    """A checkpoint split into shards: ``weight_map`` gives each tensor's file, beside the index."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProgramError(f"{path}: not a shard index with a weight_map ({type(e).__name__}: {e})") from None
    files = {name: path.parent / file for name, file in weight_map.items()}
    absent = sorted({f.name for f in files.values() if not f.is_file()})
    if absent:
        raise ProgramError(
            f"{path} names {len(absent)} shard file(s) not beside it, the first {absent[0]}: "
            "copy the whole checkpoint directory"
        )
    return Weights(path, files)

"""``autoshard export``: a training checkpoint back to the single-device state dict.

A checkpoint (``autoshard.runtime.state``) holds every tensor in the single-device model's
coordinates, whatever plan wrote it, so exporting is reading each full tensor whole on one
process (DCP without a process group) and writing it under the model's names: a tied
parameter under each of its names, persistent buffers (a causal mask kept as a buffer, routing
biases) with the parameters.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from autoshard.errors import AutoshardError, check_output_file
from autoshard.runtime import durable

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def single_device_state(checkpoint: str | Path, dtype: str = "fp32") -> tuple[dict[str, torch.Tensor], Path, list]:
    """The single-device state dict a checkpoint holds (names without the traced ``model.``
    prefix), the checkpoint it read, and the state-dict names it does not hold (a buffer the
    program never reads, or one a checkpoint written before programs kept buffers lacks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = durable.find(Path(checkpoint))
    if path is None:
        raise AutoshardError(
            f"{checkpoint}: no complete checkpoint (a directory with {durable.MARKER}, or a directory of them)"
        )
    why = durable.damage(path)
    if why is not None:
        raise AutoshardError(f"checkpoint {path} is damaged ({why}); export an older one (a step_* beside it)")
    meta = json.loads((path / "trainer.json").read_text())
    md = FileSystemReader(str(path)).read_metadata()
    full = {}
    for key, info in md.state_dict_metadata.items():
        if key.startswith("model/"):
            full[key] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
    with warnings.catch_warnings():  # DCP says it assumes one process: it is one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(full, checkpoint_id=str(path), no_dist=True)
    tensors = {k.removeprefix("model/"): v for k, v in full.items()}
    for names in meta.get("tied", []):  # a tied parameter is saved under its first name
        if names[0] in tensors:
            for other in names[1:]:
                tensors.setdefault(other, tensors[names[0]])
    wanted = meta.get("state_dict_keys") or list(tensors)
    missing = [k for k in wanted if k not in tensors]
    cast = DTYPES[dtype]
    out = {
        k.removeprefix("model."): (tensors[k].to(cast) if tensors[k].is_floating_point() else tensors[k]).contiguous()
        for k in wanted
        if k in tensors
    }
    return out, path, [k.removeprefix("model.") for k in missing]


def export(checkpoint: str | Path, out: str | Path, dtype: str = "fp32") -> dict:
    """Write the checkpoint's single-device state dict to ``out`` (``.safetensors``, or a torch
    file for ``.pt``/``.pth``/``.bin``), atomically; returns what it wrote."""
    out = Path(out)
    if out.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise AutoshardError(f"-o {out}: write a .safetensors or a torch file (.pt, .pth, .bin)")
    check_output_file(out)
    tensors, path, missing = single_device_state(checkpoint, dtype)
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        # safetensors refuses tensors sharing memory (a tied parameter's names): one copy each
        seen: set[int] = set()
        own = {}
        for k, v in tensors.items():
            own[k] = v.clone() if v.data_ptr() in seen else v
            seen.add(v.data_ptr())
        save_file(own, str(tmp), metadata={"format": "pt", "checkpoint": str(path)})
    else:
        torch.save(tensors, tmp)
    os.replace(tmp, out)
    params = sum(v.numel() for v in tensors.values())
    return {"checkpoint": str(path), "out": str(out), "tensors": len(tensors), "elements": params, "missing": missing}

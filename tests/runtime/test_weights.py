"""Starting a program from a checkpoint (``autoshard.runtime.weights``): every file form reads the
same tensors, a rank reads only the blocks of its pieces, a tied head missing from the file is
read under the embedding's name, bad checkpoints are one-line errors; and on gloo processes each
rank's chunks of compiled TP2 x PP2 and TP2 x DP2 ZeRO-3 programs (and of a transformers model's
sharded ``save_pretrained`` checkpoint) hold exactly ``slice_full`` of the file's tensors."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from autoshard.ir.program import Tied
from autoshard.runtime import program as rt
from autoshard.runtime import weights as weights_module
from autoshard.runtime.stages import materialise, piece_blocks, put_buffer, put_parameter, slice_full
from autoshard.runtime.weights import open_weights

from conftest import EXAMPLES

MODELS = Path(__file__).resolve().parents[1] / "models"


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 6, generator=gen),
        "layers.0.w.weight": torch.randn(6, 4, generator=gen),
        "norm.scale": torch.randn(6, generator=gen),
        "step": torch.tensor(3),
    }


def _write(form: str, state: dict, root: Path) -> Path:
    """``state`` saved in file form ``form``; the path to open."""
    if form == "safetensors":
        save_file(state, root / "w.safetensors")
        return root / "w.safetensors"
    if form in ("pt", "state_dict", "model"):
        torch.save(state if form == "pt" else {form: state, "epoch": 3}, root / "w.pt")
        return root / "w.pt"
    if form in ("dir-safetensors", "dir-bin"):
        save = save_file if form == "dir-safetensors" else torch.save
        save(state, root / ("model.safetensors" if form == "dir-safetensors" else "pytorch_model.bin"))
        return root
    suffix = ".safetensors" if form == "sharded-safetensors" else ".bin"
    save = save_file if suffix == ".safetensors" else torch.save
    weight_map = {}
    for i, part in enumerate([dict(list(state.items())[:2]), dict(list(state.items())[2:])]):
        file = f"shard-{i}{suffix}"
        save(part, root / file)
        weight_map.update(dict.fromkeys(part, file))
    index = "model.safetensors.index.json" if suffix == ".safetensors" else "pytorch_model.bin.index.json"
    (root / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


FORMS = ["safetensors", "pt", "state_dict", "model", "dir-safetensors", "dir-bin"]
FORMS += ["sharded-safetensors", "sharded-bin"]


@pytest.mark.parametrize("form", FORMS)
def test_every_file_form_holds_the_same_tensors(form, tmp_path):
    state = _state()
    w = open_weights(_write(form, state, tmp_path))
    assert sorted(w.names()) == sorted(state)
    for name, value in state.items():
        assert w.shape(name) == tuple(value.shape)
        got = w.read(name, piece_blocks(value.shape, None, 0, 1), tuple(value.shape), value.dtype)
        assert torch.equal(got, value), name


class _SpyFile:
    """A safetensors file that records every slice read from it."""

    def __init__(self, file, reads: list):
        self.file, self.reads = file, reads

    def keys(self):
        return self.file.keys()

    def get_slice(self, name):
        return _SpySlice(self.file.get_slice(name), name, self.reads)

    def get_tensor(self, name):
        raise AssertionError(f"{name} was read whole")


class _SpySlice:
    def __init__(self, part, name: str, reads: list):
        self.part, self.name, self.reads = part, name, reads

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        self.reads.append((self.name, tuple((s.start, s.stop) for s in index)))
        return self.part[index]


@pytest.mark.parametrize(
    "spec,rank,expected",
    [
        ((0, (16,), 0), 1, [((8, 16), (0, 6))]),
        ((1, (6,), 0), 0, [((0, 16), (0, 3))]),
        # a fused q/k/v of rows (8, 4, 4): rank 1's block of each part
        ((0, (16,), 0, (8, 4, 4)), 1, [((4, 8), (0, 6)), ((10, 12), (0, 6)), ((14, 16), (0, 6))]),
        # grouped heads (4 groups of 4 rows): rank 1 holds groups 2 and 3, one block
        ((0, (4, 4), 0), 1, [((8, 16), (0, 6))]),
    ],
)
def test_a_read_takes_only_the_blocks_of_the_piece(spec, rank, expected, tmp_path, monkeypatch):
    full = torch.randn(16, 6).bfloat16()
    save_file({"w": full, "other": torch.randn(4, 4)}, tmp_path / "w.safetensors")
    reads = []
    real = weights_module.safe_open
    monkeypatch.setattr(weights_module, "safe_open", lambda *a, **k: _SpyFile(real(*a, **k), reads))
    w = open_weights(tmp_path / "w.safetensors")
    local = slice_full(full, spec, rank, 2)
    got = w.read("w", piece_blocks(full.shape, spec, rank, 2), tuple(local.shape), torch.float32)
    assert reads == [("w", block) for block in expected]
    assert got.dtype == torch.float32 and torch.equal(got, local.float())


def test_a_torch_file_is_mapped_not_loaded(tmp_path, monkeypatch):
    state = _state()
    torch.save(state, tmp_path / "w.pt")
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    w = open_weights(tmp_path / "w.pt")
    spec = (0, (8,), 0)
    got = w.read("embed.weight", piece_blocks((8, 6), spec, 1, 2), (4, 6), torch.float64)
    assert calls == [{"map_location": "cpu", "mmap": True, "weights_only": True}]
    assert torch.equal(got, slice_full(state["embed.weight"], spec, 1, 2).double())


def test_shards_are_opened_when_first_read_and_kept_open(tmp_path, monkeypatch):
    state = _state()
    opened = []
    real = weights_module.safe_open
    monkeypatch.setattr(
        weights_module, "safe_open", lambda path, **k: opened.append(Path(path).name) or real(path, **k)
    )
    w = open_weights(_write("sharded-safetensors", state, tmp_path))
    assert opened == []
    for _ in range(2):
        w.read("norm.scale", piece_blocks((6,), None, 0, 1), (6,), torch.float32)
        w.shape("embed.weight")
    assert opened == ["shard-1.safetensors", "shard-0.safetensors"]


# ---------------------------------------------------------------------------------------------
# materialise with weights: a hand-written stage


class _Stage(nn.Module):
    """A stage as an emitted file builds it: a split head under the tied name, a whole norm, a
    buffer the checkpoint holds and one it does not."""

    def __init__(self):
        super().__init__()
        with torch.device("meta"):
            put_parameter(self, "model.lm_head.weight", nn.Parameter(torch.empty(4, 6)))
            put_parameter(self, "model.norm.scale", nn.Parameter(torch.empty(6)))
            self.register_buffer("step", torch.empty((), dtype=torch.long))
            put_buffer(self, "model.rotary.inv_freq", torch.empty(3))


STAGE_FILE = SimpleNamespace(
    SHARDS={"model.lm_head.weight": (0, (8,), 0)},
    ORIGIN={"step": "model.step"},
    INIT={"model.rotary.inv_freq": [("arange.start_step", 1, 4, 1, {"dtype": "torch.float32"})]},
    __file__="stage7.py",
)
TIED = (Tied(("model.embed.weight", "model.lm_head.weight"), (0, 1)),)


def test_a_tied_head_absent_from_the_file_is_read_as_the_embedding(tmp_path):
    state = _state()  # no lm_head.weight, as transformers saves a tied head
    save_file(state, tmp_path / "w.safetensors")
    w = open_weights(tmp_path / "w.safetensors")
    assert w.find("model.lm_head.weight", TIED) == "embed.weight" and w.find("model.lm_head.weight") is None
    stage = materialise(_Stage(), STAGE_FILE, torch.device("cpu"), 1, 2, weights=w, tied=TIED)
    assert torch.equal(stage.get_parameter("model.lm_head.weight"), state["embed.weight"][4:])
    assert torch.equal(stage.get_parameter("model.norm.scale"), state["norm.scale"])
    assert int(stage.step) == 3  # a buffer in the file is read from it
    assert stage.get_buffer("model.rotary.inv_freq").tolist() == [1.0, 2.0, 3.0]  # one not in it: replayed


def test_a_missing_parameter_is_named_with_the_count_and_the_file(tmp_path):
    state = _state()
    del state["norm.scale"]
    save_file(state, tmp_path / "w.safetensors")
    with pytest.raises(ValueError) as e:
        materialise(_Stage(), STAGE_FILE, torch.device("cpu"), 0, 2, weights=open_weights(tmp_path / "w.safetensors"))
    assert str(e.value).startswith(
        f"{tmp_path / 'w.safetensors'} has no lm_head.weight (2 of stage7.py's 2 parameters are missing)"
    )


def test_a_full_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
    state = _state()
    state["norm.scale"] = torch.randn(5)
    save_file(state, tmp_path / "w.safetensors")
    w = open_weights(tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=r"^model.norm.scale: .* holds norm.scale as \(5,\), .* full shape is \(6,\)"):
        materialise(_Stage(), STAGE_FILE, torch.device("cpu"), 0, 2, weights=w, tied=TIED)


def _bad(root: Path, case: str) -> Path:
    if case == "nothing":
        return root / "absent.safetensors"
    if case == "empty directory":
        return root
    if case == "suffix":
        (root / "w.npz").write_bytes(b"x")
        return root / "w.npz"
    if case == "corrupt":
        (root / "w.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
        return root / "w.safetensors"
    if case == "no tensors":
        torch.save({"epoch": 3}, root / "w.pt")
        return root / "w.pt"
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    return root


@pytest.mark.parametrize(
    "case,message",
    [
        ("nothing", "absent.safetensors: no such weights file or directory"),
        ("empty directory", "holds none of model.safetensors.index.json, model.safetensors"),
        ("suffix", "w.npz: not a weights file; expected .safetensors, .pt, .pth, .bin"),
        ("corrupt", "w.safetensors: cannot read it as safetensors: "),
        ("no tensors", "w.pt: cannot read it as a torch.save'd state dict: it holds no state dict of tensors"),
        ("missing shard", "names 1 shard file(s) not beside it, the first gone.safetensors"),
    ],
)
def test_a_bad_checkpoint_is_one_line(case, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        open_weights(_bad(tmp_path, case))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# compiled programs: each rank's chunks, built from a checkpoint on its own process


def _compile(model: Path, config: str, seq: int, force: str, out: Path) -> Path:
    from autoshard.cli import main

    args = [str(model), "--config", config, "--hardware", "cpu", "--gpus", "4", "--seq-len", str(seq)]
    assert main(["compile", *args, "--global-batch", "8", "--force", force, "-o", str(out)]) == 0
    return out


def _randomised(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _file_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read whole with the libraries' own loaders."""
    from safetensors.torch import load_file

    if checkpoint.suffix == ".safetensors":
        return load_file(checkpoint)
    if (checkpoint / "pytorch_model.bin").is_file():
        return torch.load(checkpoint / "pytorch_model.bin", weights_only=True)
    return {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[tuple[Path, Path, dict]]:
    """(program, checkpoint, what each traced name should hold: the checkpoint's tensor, else the
    model's buffer) for: Llama 3 tiny at TP2 x PP2 from one safetensors file; at TP2 x DP2 ZeRO-3
    from a pytorch_model.bin directory; a tied transformers Llama at TP2 x PP2 from its bf16
    save_pretrained shards (no lm_head.weight, a non-persistent rotary table)."""
    root = tmp_path_factory.mktemp("weights")
    sys.path.insert(0, str(MODELS))
    import hf_tied
    import llama3

    llama, tied = _randomised(llama3.build("tiny")), _randomised(hf_tied.build("tiny"))
    buffers = {m: {f"model.{k}": v.clone() for k, v in m.named_buffers()} for m in (llama, tied)}  # fp32
    save_file(llama.state_dict(), root / "llama.safetensors")
    (root / "bin").mkdir()
    torch.save(llama.state_dict(), root / "bin" / "pytorch_model.bin")
    tied.to(torch.bfloat16).save_pretrained(root / "hf", max_shard_size="50KB")
    assert (root / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((root / "hf").glob("*.safetensors"))) > 1

    def expected(model: nn.Module, checkpoint: Path) -> dict[str, torch.Tensor]:
        tensors = buffers[model] | {f"model.{k}": v for k, v in _file_tensors(checkpoint).items()}
        return {k: v.float() for k, v in tensors.items()}

    programs = [
        (EXAMPLES / "llama3.py", 64, "tp=2,pp=2", "pp", root / "llama.safetensors", llama),
        (EXAMPLES / "llama3.py", 64, "tp=2,dp=2,zero=3", "z3", root / "bin", llama),
        (MODELS / "hf_tied.py", 32, "tp=2,pp=2", "tied", root / "hf", tied),
    ]
    return [
        (_compile(model, "tiny", seq, force, root / out), checkpoint, expected(built, checkpoint))
        for model, seq, force, out, checkpoint, built in programs
    ]


def _build_from_weights(rank: int, world: int, cases: list) -> list[dict]:
    """Each case's chunks on this rank, built from its checkpoint as the program does, then under
    ZeRO-3 sharded by FSDP: what each (chunk, traced name) holds."""
    results = []
    for out, checkpoint in cases:
        plan, program = rt.read_program(out)
        mesh, ranks = rt.build_mesh(plan, "cpu")
        chunk_ids = rt.chunks_of_rank(plan, ranks.pp)
        weights = open_weights(checkpoint)
        stages = rt.build_chunks(
            out, program, chunk_ids, torch.device("cpu"), ranks, weights=weights, tied=program.tied
        )
        tensors, specs = {}, {}
        for c, module in zip(chunk_ids, stages):
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                source = module.stage_file.ORIGIN.get(name, name)
                tensors[c, source] = t.detach().clone()
                specs[source] = module.stage_file.SHARDS.get(source)
        fsdp = {}
        if rt.shard_data_parallel(stages, plan, mesh):
            for c, module in zip(chunk_ids, stages):
                for name, p in module.named_parameters():
                    source = module.stage_file.ORIGIN.get(name, name)
                    fsdp[c, source] = (p.to_local().detach().clone(), p.full_tensor().detach().clone())
        results.append({"tp": (ranks.tp, ranks.tp_size), "dp": (ranks.dp, ranks.dp_size), "tensors": tensors,
                        "specs": specs, "fsdp": fsdp})  # fmt: skip
    return results


def test_each_rank_holds_exactly_its_pieces_of_the_checkpoint(cases):
    from distributed import run

    ranks = run(_build_from_weights, 4, [(out, checkpoint) for out, checkpoint, _ in cases], timeout=90)
    for i, (out, checkpoint, full) in enumerate(cases):
        held = set()
        for result in (r[i] for r in ranks):
            tp, size = result["tp"]
            pieces = {}
            for (c, source), value in result["tensors"].items():
                spec = result["specs"][source]
                pieces[c, source] = full[source] if spec is None else slice_full(full[source], spec, tp, size)
                assert torch.equal(value, pieces[c, source]), (out.name, c, source)
                held.add(source)
            dp, dp_size = result["dp"]
            assert bool(result["fsdp"]) == (out.name == "z3")
            for key, (local, whole) in result["fsdp"].items():  # ZeRO-3: FSDP shards what was read
                assert torch.equal(whole, pieces[key]) and torch.equal(local, whole.chunk(dp_size)[dp]), key
        in_file = {f"model.{k}" for k in _file_tensors(checkpoint)}
        assert in_file <= held, (out.name, sorted(in_file - held))  # every tensor of the file is held


def test_a_checkpoint_missing_parameters_stops_the_program_with_one_line(cases, tmp_path, capsys):
    out, checkpoint, _ = cases[0]
    state = _file_tensors(checkpoint)
    del state["embed.weight"]
    save_file(state, tmp_path / "partial.safetensors")
    plan, program = rt.read_program(out)
    ranks = rt.Ranks(4, 0, 0, 0, 0, 0, 2, 2, 1)
    weights = open_weights(tmp_path / "partial.safetensors")
    with pytest.raises(SystemExit) as e:
        rt.build_chunks(out, program, rt.chunks_of_rank(plan, 0), torch.device("cpu"), ranks, weights=weights)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"train.py: error: {tmp_path / 'partial.safetensors'} has no embed.weight (1 of stage0.py's")

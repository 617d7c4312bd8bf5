"""Tied weights (the output head reads the token embedding: Gemma, GPT-2, small Llama and Qwen
models): one parameter, whichever pipeline chunks hold a copy of it and however data parallelism
reduces it.

The pipeline split gives every chunk reading the parameter its own copy under one name and records
the tie; the program sums the copies' gradients over the ranks holding them. End to end, a
transformers Llama with ``tie_word_embeddings=True`` (captured by torch.export: one parameter read
twice) and the example GPT with ``head.weight = embed.weight`` (captured by torch.fx: two modules
sharing one parameter) compile and verify against the single-device model within 1e-5 under
pipeline, data, ZeRO and tensor parallelism."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.capture import capture, causal_lm_loss
from autoshard.cli import main
from autoshard.passes import RewriteContext
from autoshard.passes.contract import decisions
from autoshard.passes.pipeline_split import pipeline_split
from autoshard.runtime.program import _one_parameter
from autoshard.verify import verify

MODELS = Path(__file__).parent / "models"
sys.path.insert(0, str(MODELS))


class HeadReadsEmbedding(nn.Module):
    """Two layers between a token embedding and a head that multiplies by the embedding's weight."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return F.linear(h, self.embed.weight)


def _tokens():
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))


def _run(split, tokens):
    x = (tokens,)
    for chunk in split.chunks:
        out = chunk(*x)
        x = out if isinstance(out, tuple) else (out,)
    return split.loss(*x, tokens)


def test_each_chunk_reading_a_tied_parameter_holds_it_and_the_tie_is_recorded():
    torch.manual_seed(0)
    model = HeadReadsEmbedding()
    gm = capture(model, (_tokens(),), loss=causal_lm_loss).graph_module
    ctx = RewriteContext(stage_layers=(1, 1))
    pipeline_split(gm, ctx)
    first, last = decisions(gm).split.chunks
    assert decisions(gm).split.boundaries[0] == ["add"]  # the hidden state crosses, the parameter does not
    weight = gm.get_parameter("model.embed.weight")
    assert any(p is weight for p in first.parameters()) and any(p is weight for p in last.parameters())
    assert decisions(gm).split.tied == [{"names": ["model.embed.weight"], "chunks": [0, 1]}]
    x = _tokens()
    assert torch.allclose(_run(decisions(gm).split, x), causal_lm_loss(model(x), x))


def test_a_parameter_tied_under_two_module_names_is_recorded_with_both():
    import tied_gpt

    torch.manual_seed(0)
    model = tied_gpt.build("tiny")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    gm = capture(model, (x,)).graph_module
    ctx = RewriteContext(stage_layers=(1, 1))
    pipeline_split(gm, ctx)
    assert decisions(gm).split.tied == [{"names": ["model.embed.weight", "model.head.weight"], "chunks": [0, 1]}]
    assert torch.allclose(_run(decisions(gm).split, x), causal_lm_loss(model(x), x))
    pipeline_split(gm, RewriteContext())
    assert decisions(gm).split.tied == [{"names": ["model.embed.weight", "model.head.weight"], "chunks": [0]}]


def test_one_chunk_holding_a_tie_under_two_names_holds_one_parameter():
    chunk = nn.Module()
    chunk.embed, chunk.head = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)  # emitted separately
    weight = chunk.embed.weight
    assert _one_parameter(chunk, ["embed.weight", "head.weight"]) == "embed.weight"
    assert chunk.embed.weight is weight and chunk.head.weight is weight
    assert [n for n, _ in chunk.named_parameters()] == ["embed.weight"]
    assert _one_parameter(chunk, ["other.weight"]) is None


# (model file, config, processes, --force); interleaved and the V-shape (both copies on rank 0:
# summed locally) take four layers, one per chunk
CASES = {
    "pp2-1f1b": ("hf_tied.py", "tiny", 2, "pp=2,schedule=1f1b"),
    "pp2-interleaved": ("hf_tied.py", "tiny4", 2, "pp=2,schedule=interleaved"),
    "pp2-zbv": ("hf_tied.py", "tiny4", 2, "pp=2,schedule=zbv"),
    # ZeRO-1 reduces as ZeRO-0 does (then shards the optimizer); ZeRO-3 (FSDP, as ZeRO-2) in pp2-dp2-zero3
    "dp2-zero1": ("hf_tied.py", "tiny", 2, "dp=2,zero=1"),
    "tp2": ("hf_tied.py", "tiny", 2, "tp=2"),
    "tp2-pp2": ("hf_tied.py", "tiny", 4, "tp=2,pp=2"),
    "pp2-dp2-zero3": ("hf_tied.py", "tiny", 4, "pp=2,dp=2,zero=3,schedule=interleaved"),  # copies' shards add up
    "gpt-pp2": ("tied_gpt.py", "tiny", 2, "pp=2,schedule=1f1b"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tied_model_trains_like_the_single_device_model(case, tmp_path):
    pytest.importorskip("transformers")  # a test dependency: pip install -e '.[test]'
    model, config, gpus, pins = CASES[case]
    out = tmp_path / "out"
    args = [str(MODELS / model), "--config", config, "--hardware", "cpu", "--gpus", str(gpus), "--seq-len", "32"]
    assert main(["compile", *args, "--global-batch", "8", "--force", pins, "-o", str(out)]) == 0
    result = verify(out, steps=2, tolerance=1e-5, timeout=120)
    assert [r["rel_diff"] <= 1e-5 for r in result["steps"]] == [True, True], result["steps"]
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert result["max_copy_abs_diff"] <= 1e-5, result["max_copy_name"]
    assert not result["missing_params"]
    assert result["ok"]


def test_without_the_single_device_start_the_copies_start_and_stay_equal(tmp_path):
    """Each chunk holding a copy initialises it as the model initialises the one parameter (the
    embedding's normal init, not the head's uniform one), and the copies stay equal."""
    out = tmp_path / "out"
    args = [str(MODELS / "tied_gpt.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2", "--seq-len", "32"]
    assert main(["compile", *args, "--global-batch", "8", "--force", "pp=2,schedule=1f1b", "-o", str(out)]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(out / "train.py")]
    cmd += ["--steps", "2", "--save-params", str(tmp_path / "params")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, last = (torch.load(tmp_path / "params" / f"rank{r}.pt")["params"] for r in (0, 1))
    (embedding, _, chunk), (head, _, other) = first["model.embed.weight"], last["model.head.weight"]
    assert (chunk, other) == (0, 1)
    assert torch.equal(embedding, head)
    assert embedding.std() > 0.5  # the embedding's N(0, 1) start, trained two steps, not the head's U(-1/8, 1/8)

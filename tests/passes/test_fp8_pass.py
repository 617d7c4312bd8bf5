"""The FP8 pass: the matmuls of the plan's FP8 kinds become ``rt.fp8_*`` calls (and nothing else
does), the rewritten single-device graph computes exactly what ``autoshard verify``'s FP8
reference computes on the user's model, and every bundled example compiles with
``--precision fp8`` into stage files whose FP8 lines say what they do."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard import runtime
from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import FP8_SAVED_BYTES, analyze
from autoshard.passes.contract import RewriteContext, decisions
from autoshard.passes.fp8 import fp8, fp8_calls_only
from autoshard.verify import _fp8_matmuls

from conftest import EXAMPLES
from graphs import fp8_left, notes

sys.path.insert(0, str(EXAMPLES))
ROOT = Path(__file__).resolve().parents[2]
FP8_CALLS = (runtime.fp8_linear, runtime.fp8_matmul, runtime.fp8_grouped_mm)


def _captured(name: str):
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    cap = capture(model, (torch.zeros(2, 128, dtype=torch.long),))
    analyze(cap)
    return model, cap.graph_module


def _kinds(gm) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if "matmul_kind" in n.meta:
            out.setdefault(n.meta["matmul_kind"], []).append(n.name)
    return out


def test_matmul_kinds_follow_the_model_structure():
    _, gm = _captured("llama3")
    kinds = _kinds(gm)
    assert set(kinds) == {"attention", "mlp", "head"}
    assert sorted(k.rsplit("_", 1)[-1] for k in kinds["attention"]) == sorted(["wq", "wk", "wv", "wo"] * 2)
    assert sorted(k.rsplit("_", 1)[-1] for k in kinds["mlp"]) == sorted(["w1", "w2", "w3"] * 2)
    _, gm = _captured("deepseek_v3")
    kinds = _kinds(gm)
    # MLA's down- and up-projections reach attention through their norms: attention projections
    assert {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo"} == {k.rsplit("attn_", 1)[-1] for k in kinds["attention"]}
    assert all("gate" in k for k in kinds["router"]) and len(kinds["router"]) == 2
    assert len(kinds["experts"]) == 6 and kinds["head"] == ["model_output"]


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3", "gpt"])
def test_the_rewritten_graph_equals_the_fp8_reference_on_the_users_model(name):
    model, gm = _captured(name)
    ctx = RewriteContext(fp8=("attention", "experts", "mlp"))
    gm = fp8(gm, ctx)
    assert fp8_calls_only(gm, ctx) is None and not fp8_left(gm)
    calls = [n for n in gm.graph.nodes if n.target in FP8_CALLS]
    assert len(calls) == sum(len(v) for k, v in _kinds(gm).items() if k in ctx.fp8)
    assert all("e4m3" in n.meta["note"] for n in calls)
    untouched = [n for n in gm.graph.nodes if n.meta.get("matmul_kind") in ("head", "router")]
    assert untouched and not [n for n in untouched if n.target in FP8_CALLS]  # kept high precision
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    runtime.fp8.new_step()
    got = gm(tokens)
    got.backward()
    grads = {k: p.grad.clone() for k, p in gm.named_parameters()}
    model.zero_grad(set_to_none=True)
    runtime.fp8.new_step()
    with _fp8_matmuls(model, decisions(gm).fp8_params):
        want = causal_lm_loss(model(tokens), tokens)
        want.backward()
    assert torch.equal(got, want)  # the same math, the same order: exactly
    plain = causal_lm_loss(model(tokens), tokens)
    assert not torch.equal(plain, want)  # and it is not the fp32 model
    for k, p in model.named_parameters():
        assert torch.allclose(grads[f"model.{k}"], p.grad, rtol=1e-5, atol=1e-7), k


def test_a_kind_left_out_is_not_rewritten():
    _, gm = _captured("llama3")
    ctx = RewriteContext(fp8=("head", "mlp"))
    gm = fp8(gm, ctx)
    kinds = {n.meta["matmul_kind"] for n in gm.graph.nodes if n.target in FP8_CALLS}
    assert kinds == {"head", "mlp"}


def test_recomputation_keeps_fp8_copies_where_only_fp8_matmuls_read_a_category():
    module = __import__("llama3")
    cap = capture(module.build("tiny"), (torch.zeros(2, 128, dtype=torch.long),))
    cost = analyze(cap)
    rec, kinds = frozenset({"activation", "attention"}), ("attention", "mlp")
    assert cost.fp8_saved(rec, kinds) == {"norm_output"}  # both norms feed FP8 projections only
    assert cost.fp8_saved(rec, ("attention",)) == frozenset()  # the MLP's norm feeds bf16 matmuls
    assert cost.fp8_saved(frozenset(), kinds) == frozenset()  # no recomputation: per tensor instead
    assert cost.fp8_saved(rec | {"norm_output"}, kinds) == frozenset()  # recomputed, not kept
    # under sequence parallelism the copy would be of the all-gathered norm output: not smaller
    assert cost.fp8_saved(rec, kinds, tp=2, sp=True) == frozenset()
    assert cost.fp8_saved(rec, kinds, tp=2) == {"norm_output"}
    blk = cost.blocks[0]
    norms = sum(t.bytes(1, 128, 1) for t in blk.saved if t.category == "norm_output")
    as_is = blk.activation_bytes(1, 128, recompute=rec, fp8=kinds)
    copies = blk.activation_bytes(1, 128, recompute=rec, fp8=kinds, fp8_saved={"norm_output"})
    assert as_is - copies == pytest.approx(norms * (2 - FP8_SAVED_BYTES))
    # DeepSeek-V3's MoE layers feed the router (bf16) from the MLP's norm: no category qualifies
    module = __import__("deepseek_v3")
    ds = analyze(capture(module.build("tiny"), (torch.zeros(2, 128, dtype=torch.long),)))
    assert ds.fp8_saved(rec, ("attention", "experts", "mlp")) == frozenset()
    # the pass marks exactly the projections reading the norms' outputs
    gm = cap.graph_module
    ctx = RewriteContext(fp8=kinds, recompute=tuple(sorted(rec)), fp8_saved=("norm_output",))
    gm = fp8(gm, ctx)
    kept = {n.name for n in gm.graph.nodes if n.target in FP8_CALLS and n.kwargs.get("keep_fp8")}
    reads_norm = {n.name for n in gm.graph.nodes if n.target in FP8_CALLS and n.args[0].meta.get("op_class") == "norm"}
    assert kept == reads_norm and len(kept) == 5 * 2  # q, k, v, gate, up in each of 2 layers
    assert all("keeps x's fp8 copy" in notes(gm)[k] for k in kept)


def _compile(out: Path, model: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autoshard", "compile", model, "--config", "tiny", "--gpus", "2"]
    cmd += ["--seq-len", "128", "--global-batch", "8", *args, "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)


@pytest.mark.parametrize("name", ["gpt", "llama3", "deepseek_v3"])
def test_every_bundled_example_compiles_with_precision_fp8(name, tmp_path):
    proc = _compile(tmp_path, f"examples/{name}.py", "--hardware", "h800", "--precision", "fp8")
    assert proc.returncode == 0, proc.stderr
    code = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.py")))
    assert "rt.fp8_" in code and "fp32 accumulate" in code
    assert "left in the compute precision" not in code
    assert "FP8" in (tmp_path / "plan.md").read_text()


def test_a_transformers_conv1d_model_runs_every_matmul_in_fp8(tmp_path):
    """GPT-2's ``Conv1D`` computes ``addmm(bias, x, w)`` with the weight on the right."""
    proc = _compile(tmp_path, "tests/models/hf_zoo.py", "--config", "gpt2", "--hardware", "h100", "--precision", "fp8")
    assert proc.returncode == 0, proc.stderr
    code = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.py")))
    assert "rt.fp8_addmm(" in code and "left in the compute precision" not in code


def test_fp8_for_a_machine_without_fp8_units_is_refused_in_one_line(tmp_path):
    proc = _compile(tmp_path, "examples/llama3.py", "--hardware", "cpu", "--precision", "fp8")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "no FP8" in proc.stderr and "--precision bf16" in proc.stderr
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_an_unknown_fp8_kind_is_refused(tmp_path):
    proc = _compile(tmp_path, "examples/llama3.py", "--hardware", "h100", "--force", "fp8=attention+convs")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "fp8=attention+convs" in proc.stderr and "mlp" in proc.stderr


class _MmModel(torch.nn.Module):
    """Products written with ``torch.mm`` and the ``mm`` method, beside a ``Linear``."""

    def __init__(self, d: int = 128, vocab: int = 256):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.up = torch.nn.Parameter(torch.randn(d, 2 * d) / d**0.5)
        self.down = torch.nn.Parameter(torch.randn(2 * d, d) / d**0.5)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        b, s, d = x.shape
        h = torch.relu(torch.mm(x.reshape(b * s, d), self.up))
        return self.head(x + h.mm(self.down).reshape(b, s, d))


def test_torch_mm_by_a_weight_runs_in_fp8_as_verify_runs_it():
    """``torch.mm`` and ``Tensor.mm`` take the op table's ``fp8`` column ("product") like ``@``: the
    pass makes them ``rt.fp8_matmul`` and verify's reference runs the model's own calls so, exactly."""
    torch.manual_seed(0)
    model = _MmModel()
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    cap = capture(model, (tokens,))
    analyze(cap)
    gm = cap.graph_module
    mms = [n for n in gm.graph.nodes if n.meta.get("op") == "mm"]
    assert len(mms) == 2 and {n.meta.get("matmul_kind") for n in mms} == {"mlp"}
    ctx = RewriteContext(fp8=("mlp",))
    gm = fp8(gm, ctx)
    assert fp8_calls_only(gm, ctx) is None and not fp8_left(gm)
    assert [n.target for n in mms] == [runtime.fp8_matmul] * 2
    assert sorted(decisions(gm).fp8_params) == ["model.down", "model.up"]
    runtime.fp8.new_step()
    got = gm(tokens)
    model.zero_grad(set_to_none=True)
    runtime.fp8.new_step()
    with _fp8_matmuls(model, decisions(gm).fp8_params):
        want = causal_lm_loss(model(tokens), tokens)
    assert torch.equal(got, want)
    assert not torch.equal(got, causal_lm_loss(model(tokens), tokens))  # FP8 changed the numbers

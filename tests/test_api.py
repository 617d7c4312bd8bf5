"""``autoshard.compile(model, ...)``: the Python API writes the program the CLI writes, from a live
or a meta module, and the program rebuilds the model from what program.json records (a builder or
a transformers config); a model it cannot rebuild is refused before anything is written."""

import json
import subprocess
import sys
import textwrap

import gpt
import pytest
import torch

import autoshard
from autoshard import rebuild
from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.ir.program import Program
from autoshard.runtime.program import full_state_from_model
from autoshard.runtime.rebuild import Recipe
from autoshard.verify import verify
from autoshard.whatif import SNAPSHOT

from conftest import EXAMPLES, ROOT

HF_ZOO = ROOT / "tests" / "models" / "hf_zoo.py"
SIZES = dict(hardware="cpu", gpus=2, seq_len=32, global_batch=8, pp=2)
CLI_SIZES = ["--hardware", "cpu", "--gpus", "2", "--seq-len", "32", "--global-batch", "8", "--force", "pp=2"]


def _cli(model_file, config, out):
    assert main(["compile", str(model_file), "--config", config, *CLI_SIZES, "-o", str(out)]) == 0
    return out


def _files(out) -> dict[str, str]:
    """The text files in ``out``: the pictures beside plan.md and the snapshot of the search's
    input aside (a binary file, which names the model's file only where the CLI read one)."""
    return {p.name: p.read_text() for p in sorted(out.iterdir()) if p.suffix not in (".png", ".svg", ".pkl")}


def _program(files: dict[str, str]) -> dict:
    return json.loads(files["program.json"])


def _rebuilt_state(files: dict[str, str]) -> dict[str, torch.Tensor]:
    """The seeded single-device initialisation the program in ``files`` rebuilds."""
    return full_state_from_model(Program.from_dict(_program(files)), seed=0)


def _without_rebuild(files: dict[str, str]) -> dict[str, str]:
    program = _program(files)
    del program["rebuild"]
    return {**files, "program.json": json.dumps(program)}


def _seeded_state(build, *args) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = build(*args)
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def _same_state(full: dict, expected: dict) -> bool:
    return set(expected) <= set(full) and all(torch.equal(full[k], v.float()) for k, v in expected.items())


@pytest.fixture(scope="module")
def cli_gpt(tmp_path_factory):
    return _files(_cli(EXAMPLES / "gpt.py", "tiny", tmp_path_factory.mktemp("cli") / "gpt"))


@pytest.fixture(scope="module")
def hf_zoo():
    sys.path.insert(0, str(HF_ZOO.parent))
    import hf_zoo

    return hf_zoo


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, hf_zoo):
    """The CLI's program for hf_zoo qwen3, and the API's from the model built on meta (no builder)."""
    cli = _files(_cli(HF_ZOO, "qwen3", tmp_path_factory.mktemp("cli") / "qwen3"))
    with torch.device("meta"):
        model = hf_zoo.build("qwen3")
    api = autoshard.compile(model, out=tmp_path_factory.mktemp("api") / "qwen3", name="hf_zoo:qwen3", **SIZES)
    return cli, api


def test_a_live_module_with_its_model_file_builder_writes_the_clis_program(cli_gpt, tmp_path):
    model = gpt.build("tiny")
    program = autoshard.compile(
        model, builder=f"{EXAMPLES / 'gpt.py'}:build", builder_args=["tiny"], name="gpt:tiny", out=tmp_path, **SIZES
    )
    assert program.out == tmp_path and program.plan.mesh.pp == 2
    assert _files(tmp_path) == cli_gpt  # every file, program.json included
    assert (tmp_path / SNAPSHOT).is_file()


def test_a_meta_module_with_an_importable_builder_function(cli_gpt, tmp_path):
    with torch.device("meta"):
        model = gpt.build("tiny")
    program = autoshard.compile(
        model, builder=gpt.build, builder_args=("tiny",), name="gpt:tiny", out=tmp_path, **SIZES
    )
    files = _files(tmp_path)
    assert _program(files)["rebuild"] == {
        "function": "gpt:build",
        "args": ["tiny"],
        "kwargs": {},
        "config": None,
        "loss": None,
    }
    assert _without_rebuild(files) == _without_rebuild(cli_gpt)
    assert program.files == {k: v for k, v in files.items() if k not in ("plan.json", "plan.md")}  # the program
    assert _same_state(_rebuilt_state(files), _seeded_state(gpt.build, "tiny"))


def test_a_transformers_model_is_rebuilt_from_its_config(qwen3, hf_zoo):
    cli, api = qwen3
    files = _files(api.out)
    assert _without_rebuild(files) == _without_rebuild(cli)
    entry = _program(files)["rebuild"]
    assert entry["function"] == "transformers.models.qwen3.modeling_qwen3:Qwen3ForCausalLM"
    assert entry["config"]["class"] == "transformers.models.qwen3.configuration_qwen3:Qwen3Config"
    assert entry["config"]["values"]["num_hidden_layers"] == 2 and entry["args"] == []
    assert _same_state(_rebuilt_state(files), _seeded_state(hf_zoo.build, "qwen3"))


def test_a_live_transformers_model_compiles_to_the_same_program(qwen3, hf_zoo):
    _, from_meta = qwen3
    tokens = torch.randint(0, 128, (2, SIZES["seq_len"]))  # live inputs, as for the live model
    program = autoshard.compile(hf_zoo.build("qwen3"), (tokens,), out=None, name="hf_zoo:qwen3", **SIZES)
    assert program.out is None and program.files == from_meta.files


def test_an_api_written_program_verifies(qwen3):
    _, api = qwen3
    result = verify(api.out, steps=2, tolerance=1e-5)
    assert result["ok"], result


def _lambda_builder():
    return lambda: gpt.build("tiny")


REFUSED = {
    "no builder": (dict(), 'cannot record how to rebuild GPT.*builder="package.module:function"'),
    "lambda builder": (dict(builder=_lambda_builder()), "<lambda>.*cannot be imported"),
    "builder not importable": (dict(builder="no_such_module:build"), "'no_such_module:build' cannot be imported"),
    "arguments not JSON": (dict(builder=gpt.build, builder_args=[gpt.CONFIGS["tiny"]]), "builder_args must be JSON"),
    "a different model": (
        dict(builder=f"{EXAMPLES / 'llama3.py'}:build", builder_args=["tiny"]),
        "builds a different model than the one given",
    ),
    "loss not importable": (
        dict(builder=gpt.build, builder_args=["tiny"], loss=lambda out, tokens: out.sum()),
        "loss <lambda> is defined in test_api, so it cannot be imported",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_model_it_cannot_rebuild_is_refused_before_anything_is_written(case, tmp_path):
    kwargs, message = REFUSED[case]
    with torch.device("meta"):
        model = gpt.build("tiny")
    out = tmp_path / "out"
    with pytest.raises(AutoshardError, match=message) as error:
        autoshard.compile(model, out=out, **kwargs, **SIZES)
    assert "\n" not in str(error.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_builder_defined_in_main_is_refused(tmp_path):
    script = tmp_path / "train_here.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(EXAMPLES)!r})
        import autoshard, gpt

        def build():
            return gpt.build("tiny")

        try:
            autoshard.compile(build(), builder=build, out={str(tmp_path / "out")!r}, hardware="cpu", gpus=2,
                              seq_len=32, global_batch=8)
        except autoshard.AutoshardError as e:
            print(e)
        """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "builder build is defined in __main__, so it cannot be imported" in proc.stdout
    assert 'pass builder="package.module:function"' in proc.stdout
    assert not (tmp_path / "out").exists()


def test_the_clis_recipe_is_the_model_file_its_config_and_its_loss(tmp_path):
    model_file = tmp_path / "with_loss.py"
    model_file.write_text(
        "import torch\n\n"
        "def make(config):\n    return torch.nn.Linear(2, 2)\n\n"
        "def loss(output, tokens):\n    return output.sum()\n"
    )
    recipe = rebuild.for_file(str(model_file), "make", "small")
    assert recipe == Recipe(f"{model_file}:make", ("small",), {}, None, f"{model_file}:loss")
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe
    assert isinstance(recipe.build("meta"), torch.nn.Linear) and recipe.loss_function().__name__ == "loss"
    assert rebuild.for_file(str(EXAMPLES / "gpt.py"), None, "tiny").loss is None


def test_an_importable_loss_is_recorded_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text("def mean_logit(output, tokens):\n    return output.mean()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_losses

    recipe = rebuild.for_model(gpt.build("tiny"), gpt.build, [], {"config": "tiny"}, loss=my_losses.mean_logit)
    assert (recipe.function, recipe.args, recipe.kwargs) == ("gpt:build", (), {"config": "tiny"})
    assert recipe.loss == "my_losses:mean_logit" and recipe.loss_function() is my_losses.mean_logit

"""The command line: inspect and estimate output, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from autoshard.cli import main

from conftest import EXAMPLES


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_json_has_the_documented_keys(capsys):
    code, out, _ = run(capsys, "inspect", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--seq-len", "64", "--json")
    assert code == 0
    info = json.loads(out)
    assert {"params", "flops_per_token", "layers", "activation_bytes_per_layer"} <= info.keys()
    assert info["layers"] == 2 and len(info["activation_bytes_per_layer"]) == 2
    assert info["flops_per_token"]["training"] == pytest.approx(3 * info["flops_per_token"]["forward"])
    assert set(info["op_classes"]) >= {"matmul", "attention"}


def test_inspect_text_shows_structure(capsys):
    code, out, _ = run(capsys, "inspect", str(EXAMPLES / "deepseek_v3.py"), "--config", "tiny", "--seq-len", "32")
    assert code == 0
    assert "kind 0 (Block) x1 [layers 0]" in out and "kind 1 (Block) x2 [layers 1-2]" in out
    assert "experts" in out


def test_estimate_reproduces_the_worked_example(capsys):
    code, out, _ = run(
        capsys,
        "estimate",
        "--params",
        "2e12",
        "--tokens",
        "40e12",
        "--hardware",
        "h100",
        "--mfu",
        "0.5",
        "--gpus",
        "2048",
        "--zero",
        "3",
        "--json",
    )
    assert code == 0
    got = json.loads(out)
    assert got["flops"] == pytest.approx(4.8e26)
    assert got["gpus_for_model_states"] == 400
    assert got["gpu_years"] == pytest.approx(30_700, rel=0.01)
    assert got["model_state_bytes_per_gpu"] == pytest.approx(15.6e9, rel=0.01)


def _model_file(tmp_path, body: str):
    f = tmp_path / "m.py"
    assert not f.exists()
    f.write_text("import torch\n" + body)
    return str(f)


GOOD_SAMPLE = "def sample_inputs(config, batch, seq):\n    return (torch.zeros(batch, seq, dtype=torch.long),)\n"


@pytest.mark.parametrize(
    "case,expected",
    [
        ("missing_file", "model file not found"),
        ("no_build", "defines no function build()"),
        ("builder_raises", "build(None) raised RuntimeError: boom (at m.py:3"),
        (
            "unknown_config",
            "unknown config 'huge' for llama3.py; choose one of: tiny, small, 1b, 8b, 70b, 405b, 2t, deep",
        ),
        ("untraceable", "cannot trace the model at m.py:"),
        ("bad_seq", "argument --seq-len: must be positive, got 0"),
    ],
)
def test_inspect_bad_input(tmp_path, capsys, case, expected):
    model = {
        "missing_file": lambda: str(tmp_path / "nope.py"),
        "no_build": lambda: _model_file(tmp_path, "x = 1\n"),
        "builder_raises": lambda: _model_file(
            tmp_path, "def build(config=None):\n    raise RuntimeError('boom')\n" + GOOD_SAMPLE
        ),
        "unknown_config": lambda: str(EXAMPLES / "llama3.py"),
        "untraceable": lambda: _model_file(
            tmp_path,
            "class M(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.e = torch.nn.Embedding(8, 4)\n"
            "    def forward(self, tokens):\n"
            "        return self.e(tokens[: int(tokens.max())])\n"
            "def build(config=None):\n    return M()\n" + GOOD_SAMPLE,
        ),
        "bad_seq": lambda: str(EXAMPLES / "llama3.py"),
    }[case]()
    argv = ["inspect", model, "--seq-len", "0" if case == "bad_seq" else "16"]
    if case == "unknown_config":
        argv += ["--config", "huge"]
    with pytest.raises(SystemExit) if case == "bad_seq" else _nothing() as raised:
        code, _, err = run(capsys, *argv)
    if case == "bad_seq":
        code, err = raised.value.code, capsys.readouterr().err
    assert code == 2
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--hardware", "h900"], "unknown hardware 'h900'; known profiles:"),
        (["--hardware", "BAD_TOML"], "malformed TOML in"),
        (["--hardware", "h100", "--params", "-1"], "argument --params: must be positive, got -1"),
        (["--hardware", "h100", "--mfu", "1.5"], "must be a fraction in (0, 1]"),
        (["--hardware", "h100", "--gpus", "0"], "argument --gpus: must be positive"),
    ],
)
def test_estimate_bad_input(tmp_path, argv, expected):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    argv = [str(bad) if a == "BAD_TOML" else a for a in argv]
    base = ["estimate", "--params", "1e9", "--tokens", "1e12"]
    proc = subprocess.run([sys.executable, "-m", "autoshard", *base, *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "autoshard",
            "estimate",
            "--params",
            "1e9",
            "--tokens",
            "1e9",
            "--hardware",
            "h900",
            "--debug",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_hardware_lists_profiles(capsys):
    code, out, _ = run(capsys, "hardware")
    assert code == 0 and "gb200-nvl72" in out and "h800" in out


def test_output_piped_into_head_ends_quietly(monkeypatch):
    """A reader that stops early (``| head -1``) must not get a traceback: the pipe's read end is
    closed before anything is written, so the first write fails with EPIPE."""
    import io
    import os

    read, write = os.pipe()
    os.close(read)
    stdout = io.TextIOWrapper(os.fdopen(write, "wb", buffering=0), write_through=True)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["hardware"]) == 0

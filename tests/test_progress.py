"""The progress line (``autoshard.progress``): on a terminal, long work names its stages on stderr;
piped, ``--quiet`` or ``--json``, nothing of it appears and stdout is what it always was."""

import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import warnings

import pytest

from autoshard import calibrate, progress
from autoshard.cli import build_parser

from conftest import EXAMPLES, ROOT

TINY = [str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "h100", "--gpus", "8", "--seq-len", "512"]
TINY += ["--global-batch", "16"]


def cli(*argv: str, terminal: bool) -> tuple[int, str, str]:
    """``python -m autoshard ARGV``: (exit code, stdout, stderr), stdout always a pipe, stderr a
    pseudo-terminal 200 columns wide where ``terminal``, else a pipe."""
    cmd = [sys.executable, "-m", "autoshard", *argv]
    env = {**os.environ, "AUTOSHARD_WORKERS": "1"}  # one process: a 2-core test machine is shared
    if not terminal:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        return done.returncode, done.stdout, done.stderr
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=side, stdin=subprocess.DEVNULL)
    os.close(side)
    err = b""
    while True:  # read as it comes: a full terminal buffer would block the command
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the command closed its end (EIO on Linux)
            break
        if not chunk:
            break
        err += chunk
    os.close(main)
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(), out, err.decode()


def drawn(err: str) -> list[str]:
    """The progress lines drawn, in order."""
    return [part for part in err.split(progress.CLEAR) if part]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The tiny compile, once on a terminal and once piped, into the same folder."""
    out = tmp_path_factory.mktemp("tiny")
    on_terminal = cli("compile", *TINY, "-o", str(out), terminal=True)
    piped = cli("compile", *TINY, "-o", str(out), terminal=False)
    return out, on_terminal, piped


def test_a_terminal_sees_the_stages_of_compile(compiled):
    _, (code, out, err), _ = compiled
    assert code == 0
    lines = drawn(err)
    stages = [line.split(":")[1].strip().split(" (")[0] for line in lines]
    for stage in ("build on meta", "trace", "analysis", "search", "rewrite passes", "code generation", "writing"):
        assert stage in stages, (stage, lines)
    assert stages.index("trace") < stages.index("search") < stages.index("writing")
    assert any(line.startswith("autoshard: rewrite passes: pipeline_split") for line in lines), lines
    assert err.endswith(progress.CLEAR)  # the last line is cleared before the summary is printed
    assert "\n" not in err  # one line, rewritten in place


def test_piped_output_has_no_progress_and_the_same_stdout(compiled):
    _, (_, terminal_out, _), (code, out, err) = compiled
    assert code == 0
    assert "\x1b[K" not in err and "\r" not in err and "autoshard: search" not in err
    assert out == terminal_out  # what a terminal's stdout gets does not change with progress shown
    assert out.splitlines()[0].startswith("TP1 x PP1 x CP1 x EP1 x DP8, ")
    assert out.splitlines()[1].startswith("wrote ")


def test_quiet_shows_no_progress_and_no_informational_lines(tmp_path):
    code, out, err = cli("--quiet", "compile", *TINY, "--plan-only", "-o", str(tmp_path), terminal=True)
    assert code == 0
    assert err == ""
    assert len(out.splitlines()) == 1 and "s/step" in out  # the result; "wrote ..." is informational
    assert (tmp_path / "plan.json").is_file()


def test_json_output_parses_and_carries_no_progress():
    argv = ("inspect", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--seq-len", "64")
    code, out, err = cli(*argv, "--json", terminal=True)
    assert code == 0 and err == ""
    assert json.loads(out)["layers"] > 0
    code, _, err = cli(*argv, terminal=True)  # the same command shows progress without --json
    assert code == 0 and "autoshard: trace" in err


def test_verify_at_scale_names_the_rank_it_replays(compiled):
    folder, _, _ = compiled
    code, out, err = cli("verify", str(folder), "--at-scale", terminal=True)
    assert code == 0, out
    lines = drawn(err)
    assert any("replaying rank 0 (pipeline stage 0 of 1), done 0 of 1" in line for line in lines), lines
    assert out.rstrip().endswith("OK: the program does what the plan promises")


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_and_debug_are_read_before_or_after_the_command(where):
    flags, argv = ["--quiet", "--debug"], ["hardware"]
    args = build_parser().parse_args(flags + argv if where == "before" else argv + flags)
    assert args.quiet and args.debug
    args = build_parser().parse_args(argv)
    assert not args.quiet and not args.debug


def session(stream: io.StringIO, quiet: bool = False):
    return progress.session(show=True, quiet=quiet, stream=stream)


def test_updates_are_throttled_and_keep_the_latest_numbers(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress, "_clock", lambda: clock[0])
    line = io.StringIO()
    with session(line), progress.stage("search"):
        progress.update(nodes=16)  # no time has passed since the stage was drawn: not drawn
        progress.update(nodes=32)
        clock[0] += progress.MIN_INTERVAL_S
        progress.update(best_s=4.5)
        shown = drawn(line.getvalue())
    assert shown == ["autoshard: search", "autoshard: search: nodes 32, best 4.5 s"]
    assert line.getvalue().endswith(progress.CLEAR)


def test_nested_stages_and_elapsed_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress, "_clock", lambda: clock[0])
    line = io.StringIO()
    with session(line), progress.stage("search"):
        clock[0] += 3.0
        with progress.stage("neighbouring meshes"):
            clock[0] += 1.0
            progress.update(nodes=12288)
        shown = drawn(line.getvalue())
    assert shown[-2:] == [
        "autoshard: search: neighbouring meshes (4 s): nodes 12,288",  # the time since "search" began
        "autoshard: search (4 s)",  # the inner stage's numbers go with it
    ]


def test_a_forked_process_never_draws(monkeypatch):
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.0)  # every update draws, where it may
    line = io.StringIO()
    with session(line), progress.stage("search"):
        before = line.getvalue()
        pid = os.fork()
        if pid == 0:  # the helper: whatever it does, nothing reaches the (inherited) stream
            progress.update(nodes=1)
            with progress.stage("elsewhere"):
                pass
            os._exit(0 if line.getvalue() == before else 1)
        assert os.waitpid(pid, 0)[1] == 0
        progress.update(nodes=2)  # the parent still draws
    assert "nodes 2" in line.getvalue()


def test_echo_and_note_clear_the_line_first_and_quiet_drops_notes(capsys):
    line = io.StringIO()
    with session(line), progress.stage("writing"):
        progress.echo("a result")
        progress.note("wrote out/")
        shown = line.getvalue()
    assert capsys.readouterr().out == "a result\nwrote out/\n"
    # cleared before each line, and drawn again after it
    assert shown.count(progress.CLEAR + "autoshard: writing") == 3
    with session(io.StringIO(), quiet=True):
        progress.echo("a result")
        progress.note("wrote out/")
    assert capsys.readouterr().out == "a result\n"


def test_a_warning_clears_the_line():
    line = io.StringIO()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda *args, **kwargs: seen.append(line.getvalue())
        with session(line), progress.stage("trace"):
            warnings.warn("something", UserWarning, stacklevel=1)
    assert seen and seen[0].endswith("autoshard: trace" + progress.CLEAR)


def test_outside_a_session_nothing_is_drawn(capsys):
    with progress.stage("search"):
        progress.update(nodes=1)
        progress.note("a note")
    captured = capsys.readouterr()
    assert captured.out == "a note\n" and captured.err == ""


def test_calibrate_names_its_measurement(capsys):
    line = io.StringIO()
    with session(line):
        calibrate.measure_memory("cpu", quick=True)
    assert drawn(line.getvalue())[0] == "autoshard: memory copy"
    assert capsys.readouterr().out.startswith("calibrate: memory copy ")

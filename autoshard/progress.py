"""What long work shows while it runs, and the informational lines of a command.

On a terminal, long work (capture, the search, the rewrite passes, ``verify --at-scale``,
``calibrate``) shows one line on stderr, rewritten in place: the stage it is in and that stage's
latest numbers, e.g. ``autoshard: search (3 s): nodes 12,288, bound 4.512 s, best 4.7 s``.
Where stderr is not a terminal, or under ``--quiet`` or ``--json``, it shows nothing, so piped
output is byte for byte what it would be without this module.

    with progress.session(show=sys.stderr.isatty(), quiet=False):  # once, by the command line
        with progress.stage("search"):       # a named stage; a nested one reads "search: refine"
            progress.update(nodes=12288, bound_s=4.512)  # the stage's numbers, throttled
        progress.echo("gemm: 1.2 TFLOP/s")   # a line of the command's report, on stdout
        progress.note("wrote out/")          # an informational line on stdout (none under quiet)

Outside a session, and in a session that shows nothing, ``stage`` and ``update`` do nothing and
``echo`` and ``note`` print, so library code calls them unconditionally; ``update`` costs a
function call there, cheap enough for a hot loop that calls it every few iterations. ``stage``
also decorates a function: each call is the stage. Only the process that opened the session
draws: a forked search helper inherits the session but never writes to the terminal.

The line is cleared before anything is printed through this module (``echo``, ``note``), before
a warning is shown, when the outermost stage ends and when the session closes, so that normal
output never lands on the progress line. Output of other processes (a spawned rank) is not seen:
where they print, open no stage.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator

MIN_INTERVAL_S = 0.1  # ``update`` redraws at most this often: a terminal flooded is a slow search
CLEAR = "\r\x1b[K"  # back to the start of the line, erase to its end
_clock = time.monotonic


class _Session:
    def __init__(self, show: bool, quiet: bool, stream):
        self.show = show
        self.quiet = quiet
        self.stream = stream
        self.pid = os.getpid()
        self.stages: list[tuple[str, float, dict]] = []  # (name, start, fields), outermost first
        self.shown = False
        self.drawn_at = 0.0

    def drawing(self) -> bool:
        return self.show and os.getpid() == self.pid

    def draw(self) -> None:
        if not self.stages:
            self.clear()
            return
        now = _clock()
        name = ": ".join(s[0] for s in self.stages)
        fields = self.stages[-1][2]
        shown = ", ".join(_field(k, v) for k, v in fields.items() if v is not None)
        elapsed = now - self.stages[0][1]
        line = f"autoshard: {name}" + (f" ({elapsed:.0f} s)" if elapsed >= 1 else "") + (f": {shown}" if shown else "")
        width = _columns(self.stream)
        if len(line) >= width:  # a wrapped line cannot be rewritten in place
            line = line[: max(0, width - 2)] + "…"
        self.stream.write(CLEAR + line)
        self.stream.flush()
        self.shown, self.drawn_at = True, now

    def clear(self) -> None:
        if self.shown:
            self.stream.write(CLEAR)
            self.stream.flush()
            self.shown = False


_session = _Session(show=False, quiet=False, stream=sys.stderr)  # outside a session: no progress, notes print


@contextlib.contextmanager
def session(show: bool, quiet: bool = False, stream=None) -> Iterator[None]:
    """Within the block, show progress on ``stream`` (default stderr) where ``show``, and drop
    ``note`` lines where ``quiet``. The line is cleared when the block ends, however it ends."""
    global _session
    outer = _session
    _session = _Session(show, quiet, stream if stream is not None else sys.stderr)
    shown_warning = warnings.showwarning

    def clear_then_warn(*args, **kwargs):
        if _session.drawing():
            _session.clear()
        shown_warning(*args, **kwargs)

    if show:
        warnings.showwarning = clear_then_warn
    try:
        yield
    finally:
        if _session.drawing():
            _session.clear()
        if show:
            warnings.showwarning = shown_warning
        _session = outer


def showing() -> bool:
    """Whether progress is drawn here: callers whose numbers cost something to gather ask first."""
    return _session.drawing()


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """The block is the stage ``name`` (inside the enclosing stage, if any); it is drawn on entry,
    its numbers (``update``) are dropped when it ends."""
    s = _session
    if not s.drawing():
        yield
        return
    s.stages.append((name, _clock(), {}))
    s.draw()
    try:
        yield
    finally:
        s.stages.pop()
        s.draw()


def update(**fields) -> None:
    """Set the innermost stage's numbers, shown as ``key value``: whole numbers with thousands
    separators, other numbers to four figures, a key ending in ``_s`` as seconds (``bound_s=4.5``
    shows ``bound 4.5 s``); None hides a field. Redrawn at most every ``MIN_INTERVAL_S``; the
    latest numbers are kept for the next redraw."""
    s = _session
    if not s.show or not s.stages or os.getpid() != s.pid:
        return
    s.stages[-1][2].update(fields)
    if _clock() - s.drawn_at >= MIN_INTERVAL_S:
        s.draw()


def clear() -> None:
    """Erase the progress line (it comes back at the next ``update`` or stage), before printing
    something that does not go through ``note``."""
    if _session.drawing():
        _session.clear()


def echo(line: str) -> None:
    """Print a line of a command's report on stdout, ``--quiet`` or not; the progress line is
    cleared first and redrawn after it."""
    s = _session
    drawing = s.drawing()
    if drawing:
        s.clear()
    print(line, flush=True)
    if drawing and s.stages:
        s.draw()


def note(line: str) -> None:
    """``echo`` an informational line (where output went, what to run next), unless the session
    is quiet."""
    if not _session.quiet:
        echo(line)


def _field(key: str, value) -> str:
    if isinstance(value, str):
        return f"{key} {value}"
    if key.endswith("_s"):
        return f"{key[:-2]} {value:.4g} s"
    if isinstance(value, int):
        return f"{key} {value:,}"
    return f"{key} {value:.4g}"


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80

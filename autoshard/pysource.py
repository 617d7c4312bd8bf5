"""Python source as the emitted program writes it: fx's generated statements tidied to the layout
``ruff format`` gives (keyword arguments without spaces, double quotes, simple powers hugged,
lines over the limit split at their last bracket the way it splits them), comments wrapped at
the limit, and Python literals for the tables. Small pieces the stage and layer files are built
from (``autoshard.stagecode``)."""

from __future__ import annotations

import io
import json
import math
import re
import textwrap
import tokenize

LIMIT = 120  # the line length of the project's ruff settings, which the emitted files meet
_OPEN, _CLOSE = "([{", ")]}"


def tidy(statement: str, renames: dict[str, str] | None = None) -> str:
    """One fx-generated statement as ``ruff format`` writes it (keyword arguments, quotes, simple
    powers, exponents), with the names in ``renames`` (a global fx named, not an attribute)
    replaced."""
    renames = renames or {}
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(statement).readline) if t.type != tokenize.ENDMARKER]
    tokens = [t for t in tokens if t.type not in (tokenize.NEWLINE, tokenize.NL)]
    edits, depth = [], 0
    for i, t in enumerate(tokens):
        before = tokens[i - 1] if i else None
        if t.type == tokenize.OP and t.string in _OPEN:
            depth += 1
        elif t.type == tokenize.OP and t.string in _CLOSE:
            depth -= 1
        elif t.type == tokenize.NAME and t.string in renames and not (before and before.string == "."):
            edits.append((t.start[1], t.end[1], renames[t.string]))
        elif t.type == tokenize.STRING and t.string.startswith("'") and '"' not in t.string and "\\" not in t.string:
            edits.append((t.start[1], t.end[1], f'"{t.string[1:-1]}"'))
        elif t.type == tokenize.NUMBER and re.search(r"[eE]\+|E", t.string):  # 1e+38 -> 1e38
            edits.append((t.start[1], t.end[1], re.sub(r"[eE]\+?", "e", t.string)))
        elif t.type == tokenize.OP and t.string == "=" and depth > 0:
            edits.append((before.end[1], tokens[i + 1].start[1], "="))
        elif t.type == tokenize.OP and t.string == "**" and _simple_power(tokens, i):
            edits.append((before.end[1], tokens[i + 1].start[1], "**"))
    for start, end, text in sorted(edits, reverse=True):
        statement = statement[:start] + text + statement[end:]
    return statement


def _simple_power(tokens: list, i: int) -> bool:
    """Both operands of the ``**`` at ``tokens[i]`` are names, numbers or attribute chains of
    names (the right one maybe negated): ``ruff format`` writes ``a**b`` for those."""
    j = i - 1
    while j >= 2 and tokens[j - 1].string == "." and tokens[j - 2].type == tokenize.NAME:
        j -= 2
    if tokens[j].type not in (tokenize.NAME, tokenize.NUMBER) or (j and tokens[j - 1].string in (".", ")", "]")):
        return False
    k = i + 1 + (tokens[i + 1].string == "-")
    if k >= len(tokens) or tokens[k].type not in (tokenize.NAME, tokenize.NUMBER):
        return False
    while k + 2 < len(tokens) and tokens[k + 1].string == "." and tokens[k + 2].type == tokenize.NAME:
        k += 2
    return k + 1 >= len(tokens) or tokens[k + 1].string not in ("(", "[", "**")


def wrap(line: str, indent: str) -> list[str]:
    """``line`` at ``indent``, split as ``ruff format`` splits a line over the limit: at its last
    bracket pair, the contents on one line of their own where they fit (the arguments of a call,
    a subscript, a literal of one element), else one element a line with a trailing comma (each
    element split again where it is still too long)."""
    if len(indent) + len(line) <= LIMIT:
        return [indent + line]
    pair = _last_pair(line)
    if pair is None:
        return [indent + line]
    start, end = pair
    head, body, tail = line[: start + 1], line[start + 1 : end].strip(), line[end:]
    inner = indent + "    "
    elements = _split_top(body)
    literal = start == 0 or not (line[start - 1].isalnum() or line[start - 1] in "_)]")
    if len(inner) + len(body) <= LIMIT and not body.endswith(",") and not (literal and len(elements) > 1):
        return [indent + head, inner + body, indent + tail]
    lines = [indent + head]
    for element in elements:
        lines += wrap(element + ",", inner)
    return [*lines, indent + tail]


def _last_pair(line: str) -> tuple[int, int] | None:
    """The positions of the last closing bracket of ``line`` (outside strings) and its opening one."""
    stack, last = [], None
    for t in tokenize.generate_tokens(io.StringIO(line).readline):
        if t.type == tokenize.OP and t.string in _OPEN:
            stack.append(t.start[1])
        elif t.type == tokenize.OP and t.string in _CLOSE and stack:
            opened = stack.pop()
            if not stack:
                last = (opened, t.start[1])
    return last


def _split_top(body: str) -> list[str]:
    """``body`` split at its top-level commas."""
    parts, depth, start = [], 0, 0
    for t in tokenize.generate_tokens(io.StringIO(body).readline):
        if t.type == tokenize.OP and t.string in _OPEN:
            depth += 1
        elif t.type == tokenize.OP and t.string in _CLOSE:
            depth -= 1
        elif t.type == tokenize.OP and t.string == "," and depth == 0:
            parts.append(body[start : t.start[1]].strip())
            start = t.end[1]
    rest = body[start:].strip()
    return [p for p in [*parts, rest] if p]


def dropped(names: list[str], indent: str) -> list[str]:
    """``a = b = None`` for ``names`` at ``indent``, as many lines as the limit needs."""
    lines, run = [], []
    for name in names:
        if run and len(indent) + len(" = ".join([*run, name])) + len(" = None") > LIMIT:
            lines.append(f"{indent}{' = '.join(run)} = None")
            run = []
        run.append(name)
    return [*lines, f"{indent}{' = '.join(run)} = None"] if run else lines


def comment(text: str, indent: str) -> list[str]:
    """``text`` as comment lines at ``indent``, wrapped at the limit."""
    width = LIMIT - len(indent) - 2
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)]


def literal(value) -> str:
    """``value`` (lists, tuples, dicts, numbers, strings, None) as Python source."""
    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'
    if isinstance(value, tuple):
        return "(" + ", ".join(literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def table(name: str, entries: dict | list, about: str, indent: str = "") -> list[str]:
    """``name = {...}`` (or a list) under the comment ``about``, one entry a line; nothing where
    it has no entries (the runtime reads a missing table as empty)."""
    if not entries:
        return []
    inner = indent + "    "
    if isinstance(entries, dict):
        rows = [line for k, v in entries.items() for line in wrap(f"{literal(k)}: {literal(v)},", inner)]
        brackets = "{}"
    else:
        rows = [line for v in entries for line in wrap(f"{literal(v)},", inner)]
        brackets = "[]"
    return [*comment(about, indent), f"{indent}{name} = {brackets[0]}", *rows, f"{indent}{brackets[1]}"]

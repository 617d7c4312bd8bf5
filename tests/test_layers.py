"""Layers point one way: the runtime knows nothing of planning or rewriting, capture and the cost
formulas nothing of plans; the project cites no file outside itself; and a function a reader
cannot follow on one screen says why it is long."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"autoshard": ROOT / "autoshard", "autoshard.passes": ROOT / "passes",
                "autoshard.cost_models": ROOT / "cost_models"}  # fmt: skip

PLANNING = ("autoshard.planner", "autoshard.compiler")
EMITTING = ("autoshard.passes", "autoshard.codegen", "autoshard.report", "autoshard.stagecode", "autoshard.cli")
EMITTING += ("autoshard.layercode", "autoshard.pysource")
ABOVE_THE_RUNTIME = (*PLANNING, *EMITTING, "autoshard.capture", "autoshard.cost_models", "autoshard.atscale",
                     "autoshard.verify", "autoshard.rebuild", "autoshard.modelfile", "autoshard.summary")  # fmt: skip

RULES = {
    # the emitted program imports torch and autoshard.runtime (and the ground floor) only
    "autoshard.runtime": ABOVE_THE_RUNTIME,
    "autoshard.kernels": (*ABOVE_THE_RUNTIME, "autoshard.runtime"),
    "autoshard.cost_models": (*PLANNING, *EMITTING),
    "autoshard.capture": (*PLANNING, "autoshard.codegen", "autoshard.report", "autoshard.cli"),
    "autoshard.passes": ("autoshard.planner", "autoshard.compiler", "autoshard.codegen", "autoshard.cli"),
}
# the ground floor: what every stage may import; it imports nothing of autoshard's but itself
# and the error types
GROUND_FLOOR, GROUND_ALLOWS = "autoshard.ir", ("autoshard.ir", "autoshard.errors")
# modules whose functions import the commands they run, so that starting them loads no torch
LAZY_BY_DESIGN = ("autoshard", "autoshard.cli")


def _modules():
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "autoshard" and parts and parts[0] in ("passes", "cost_models"):
                continue
            yield name, path


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = sorted(_modules())


def test_the_scan_sees_the_layers():
    names = {n for n, _ in MODULES}
    assert {"autoshard.runtime.program", "autoshard.cost_models.analyze", "autoshard.passes.tensor_parallel"} <= names


@pytest.mark.parametrize("name,path", MODULES, ids=[n for n, _ in MODULES])
def test_imports_point_one_way(name, path):
    for layer, forbidden in RULES.items():
        if not _under(name, layer):
            continue
        bad = sorted(i for i in _imports(path) for f in forbidden if _under(i, f))
        assert not bad, f"{name} imports {bad}"


def test_the_project_cites_no_file_outside_itself():
    outside = ("KERNELS.md", "FACTS.md", "ECOSYSTEM.md", "DESIGN.md", "STYLE.md", "../shared", "shared/")
    hits = []
    for folder in ("autoshard", "passes", "cost_models", "tests", "benchmarks", "examples", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md", ".toml", "") and path != Path(__file__):
                text = path.read_text(errors="ignore")
                hits += [f"{path.relative_to(ROOT)}: {o}" for o in outside if o in text]
    hits += [f"README.md: {o}" for o in outside if o in (ROOT / "README.md").read_text()]
    assert not hits


# ---------------------------------------------------------------------------------------------
# the import graph: every module, function-level imports included


def _edges(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """The autoshard modules ``name`` imports: (module, line, inside a function); what a
    ``TYPE_CHECKING`` block imports is not run, so it is left out."""
    known = {n for n, _ in MODULES}
    tree = ast.parse(path.read_text())
    found = []

    def target(module: str, attr: str | None) -> str | None:
        for candidate in ([f"{module}.{attr}"] if attr else []) + [module]:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                return candidate
        return None

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                hits = [target(a.name, None) for a in child.names if a.name.startswith("autoshard")]
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("autoshard"):
                hits = [target(child.module, a.name) for a in child.names]
            else:
                hits = []
            found.extend((h, child.lineno, in_function) for h in hits if h)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


EDGES = {name: _edges(name, path) for name, path in MODULES}


def test_no_import_cycles():
    graph = {name: sorted({m for m, _, _ in edges}) for name, edges in EDGES.items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def walk(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := walk(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start, [start])):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_ground_floor_imports_nothing_above_it():
    bad = [
        f"{name} imports {module}"
        for name, edges in EDGES.items()
        if _under(name, GROUND_FLOOR)
        for module, _, _ in edges
        if not any(_under(module, a) for a in GROUND_ALLOWS)
    ]
    assert not bad


def test_a_function_level_import_says_why_it_is_there():
    """An import inside a function is either a command loaded when it runs (``LAZY_BY_DESIGN``)
    or carries ``# lazy: <reason>``; none exists to step around a cycle (there are none)."""
    unexplained = []
    for name, path in MODULES:
        if name in LAZY_BY_DESIGN:
            continue
        lines = path.read_text().splitlines()
        inner = [line for _, line, in_function in EDGES[name] if in_function]
        unexplained += [f"{path.relative_to(ROOT)}:{line}" for line in inner if "# lazy:" not in lines[line - 1]]
    assert not unexplained


def test_the_graph_scan_sees_function_level_imports():
    edges = EDGES["autoshard.runtime.attention"]
    assert ("autoshard.kernels.flash", True) in {(m, inner) for m, _, inner in edges}


def test_every_package_is_installed():
    """pyproject.toml lists the packages a wheel holds; a folder left out installs nowhere."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = [p.parent.relative_to(ROOT / "autoshard") for p in (ROOT / "autoshard").rglob("__init__.py")]
    found = {".".join(("autoshard", *f.parts)) for f in folders} | {"autoshard.passes", "autoshard.cost_models"}
    assert found <= listed, sorted(found - listed)


# ---------------------------------------------------------------------------------------------
# function length: past this many lines (def line to last line) a function is split into helpers
# a reader can follow top to bottom, or its docstring says why it is long (an argument table)

MAX_FUNCTION_LINES = 60


def _long_functions(source: str) -> list[tuple[str, int, bool]]:
    """(name, lines, whether its docstring says why it is long) of each function or method of
    ``source`` over ``MAX_FUNCTION_LINES`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append((node.name, lines, "long" in (ast.get_docstring(node) or "").lower()))
    return found


def test_a_long_function_says_why():
    unexplained = {}
    for folder in PACKAGE_DIRS.values():
        for path in sorted(folder.rglob("*.py")):
            for name, lines, says_why in _long_functions(path.read_text()):
                if not says_why:
                    unexplained[f"{path.relative_to(ROOT).as_posix()}::{name}"] = lines
    left = [f"{where} ({lines} lines)" for where, lines in unexplained.items()]
    assert not left, f"over {MAX_FUNCTION_LINES} lines: split into helpers, or say why it is long: {left}"


def test_the_length_scan_counts_from_def_to_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    assert _long_functions(f"def f():\n{body}\n") == []
    assert _long_functions(f"@cache\ndef f():\n{body}\n    return 0\n") == [("f", 61, False)]
    assert _long_functions(f'class C:\n  def m(self):\n    """A long table."""\n{body}\n') == [("m", 61, True)]

"""Layers point one way: the runtime knows nothing of planning or rewriting, capture and the cost
formulas nothing of plans; and the project cites no file outside itself."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"autoshard": ROOT / "autoshard", "autoshard.passes": ROOT / "passes",
                "autoshard.cost_models": ROOT / "cost_models"}  # fmt: skip

PLANNING = ("autoshard.plan", "autoshard.planner", "autoshard.compiler", "autoshard.capabilities")
EMITTING = ("autoshard.passes", "autoshard.codegen", "autoshard.report", "autoshard.cli")
EMITTING += ("autoshard.stagecode", "autoshard.layercode", "autoshard.pysource")

RULES = {
    # the emitted program imports torch and autoshard.runtime only
    "autoshard.runtime": (*PLANNING, *EMITTING, "autoshard.capture", "autoshard.cost_models"),
    "autoshard.kernels": (*PLANNING, *EMITTING, "autoshard.capture", "autoshard.cost_models"),
    "autoshard.cost_models": (*PLANNING, *EMITTING),
    "autoshard.capture": (*PLANNING, "autoshard.codegen", "autoshard.report", "autoshard.cli"),
    "autoshard.passes": ("autoshard.planner", "autoshard.compiler", "autoshard.codegen", "autoshard.cli"),
}


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

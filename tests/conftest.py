import os
import sys
from pathlib import Path

# Run Triton kernels on CPU tensors (the interpreter); @triton.jit reads this when it decorates,
# so it must be set before any kernel module is imported (autoshard/kernels/README.md).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return EXAMPLES


def pytest_addoption(parser):
    parser.addoption(
        "--regen-golden",
        action="store_true",
        help="rewrite tests/golden/*.json from the current planner (review the diff like code)",
    )


_CACHE: dict = {}


def captured(name: str, config: str, seq: int):
    """Capture + analyze an example once per test session."""
    key = (name, config, seq)
    if key not in _CACHE:
        from autoshard.capture import capture_file
        from autoshard.cost_models.analyze import analyze

        cap = capture_file(str(EXAMPLES / f"{name}.py"), config, seq)
        _CACHE[key] = (cap, analyze(cap))
    return _CACHE[key]


def extended_profile(**fields):
    """A hardware profile extending ``extends`` (default h100) with ``fields`` (TOML values),
    written to a temporary file and loaded as a user's would be."""
    import tempfile

    from autoshard.cost_models import hardware

    path = os.path.join(tempfile.mkdtemp(), "custom.toml")
    base = fields.pop("extends", "h100")
    body = "".join(f"{k} = {v}\n" for k, v in fields.items())
    with open(path, "w") as f:
        f.write(f'name = "custom"\nextends = "{base}"\n{body}')
    return hardware.load(path)


def cache_storages(module) -> list:
    """The selective-checkpoint caches ``module`` (an ``rt.Checkpoint``) makes from now on, one per
    forward, as the list that fills while it runs (stays empty for any other module)."""
    from autoshard.runtime.checkpoint import Checkpoint

    held: list = []
    if isinstance(module, Checkpoint):
        make = module._context

        def recording():
            caching, cached = make()
            held.append(caching.storage)
            return caching, cached

        module._context = recording
    return held

"""fx's statements written as ``ruff format`` writes them, and lines split where it splits them."""

from autoshard import pysource


def test_tidy_writes_keywords_quotes_and_simple_powers_as_ruff_does():
    fx_line = "arange = torch.arange(0, n, 2, device = d, dtype = torch.float32)"
    assert pysource.tidy(fx_line) == "arange = torch.arange(0, n, 2, device=d, dtype=torch.float32)"
    assert pysource.tidy("x = f(a, 'model.layers.0')") == 'x = f(a, "model.layers.0")'
    assert pysource.tidy("p = 500000.0 ** t") == "p = 500000.0**t"
    assert pysource.tidy("p = a.b ** -c") == "p = a.b**-c"
    assert pysource.tidy("p = f(a) ** 2") == "p = f(a) ** 2"  # not simple: keeps its spaces
    assert pysource.tidy("y = x == 1") == "y = x == 1"


def test_tidy_renames_globals_but_not_attributes():
    renames = {"autoshard_runtime_norms_rms_norm": "rt.rms_norm"}
    line = "rms_norm = autoshard_runtime_norms_rms_norm(x, w.autoshard_runtime_norms_rms_norm)"
    assert pysource.tidy(line, renames) == "rms_norm = rt.rms_norm(x, w.autoshard_runtime_norms_rms_norm)"


def test_wrap_splits_at_the_last_bracket_as_ruff_does():
    short = "y = f(a, b)"
    assert pysource.wrap(short, "    ") == ["    y = f(a, b)"]
    call = "y = some_function(" + ", ".join(f"argument_{i}" for i in range(9)) + ")"
    assert pysource.wrap(call, "        ") == [
        "        y = some_function(",
        "            " + ", ".join(f"argument_{i}" for i in range(9)),
        "        )",
    ]
    # a literal of several elements goes one element a line, with a trailing comma
    steps = '[("empty.memory_format", "shape", {"dtype": "torch.float32"}), ("fill_.Scalar", "%0", 1.0)]'
    entry = f'"attention.query_norm.weight": {steps},'
    assert pysource.wrap(entry, "        ") == [
        '        "attention.query_norm.weight": [',
        '            ("empty.memory_format", "shape", {"dtype": "torch.float32"}),',
        '            ("fill_.Scalar", "%0", 1.0),',
        "        ],",
    ]


def test_an_empty_table_is_left_out():
    assert pysource.table("SHARDS", {}, "about") == []
    assert pysource.table("EXPERTS", ["a.w"], "about") == ["# about", "EXPERTS = [", '    "a.w",', "]"]


def test_numbers_and_long_deletions_as_ruff_writes_them():
    assert pysource.tidy("w = f(x, -3.4028234663852886e+38, 1E-05)") == "w = f(x, -3.4028234663852886e38, 1e-05)"
    names = [f"a_rather_long_value_name_{i}" for i in range(8)]
    lines = pysource.dropped(names, "        ")
    assert len(lines) > 1 and all(len(line) <= pysource.LIMIT for line in lines)
    assert [n for line in lines for n in line.strip().removesuffix(" = None").split(" = ")] == names

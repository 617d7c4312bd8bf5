"""``autoshard.ir.KEYS`` is the authoritative list of node.meta keys: what the code writes, what
captured graphs carry and what every pass declares are all in it, and the pass pipeline holds
each pass to its declared contract."""

import re
from pathlib import Path

import pytest
from torch import fx

from autoshard import ir
from autoshard.passes import PASSES
from autoshard.passes.contract import ContractError, Pass, RewriteContext, run_passes

from conftest import captured

ROOT = Path(__file__).resolve().parents[1]
# ``meta["k"] = ...`` (also in a tuple assignment ``meta["a"], meta["b"] = ...``), ``meta.setdefault("k"``
WRITES = re.compile(r"""meta\[["'](\w+)["']\](?=[^=\n]*(?<![!<>])=(?!=))|meta\.setdefault\(["'](\w+)["']""")


def _written_keys() -> dict[str, str]:
    found = {}
    for folder in ("autoshard", "passes", "cost_models"):
        for path in (ROOT / folder).rglob("*.py"):
            for m in WRITES.finditer(path.read_text()):
                found[m.group(1) or m.group(2)] = str(path.relative_to(ROOT))
    return found


def test_every_key_the_code_writes_is_documented():
    written = _written_keys()
    assert {"shape", "op_class", "tp_role"} <= set(written)  # the scan finds the writes at all
    known = {*ir.KEYS, *ir.GRAPH_KEYS, *ir.TORCH_KEYS}  # (the scan does not tell a node's meta from a module's)
    undocumented = {k: where for k, where in written.items() if k not in known}
    assert not undocumented


def test_every_documented_key_is_written_somewhere():
    written = _written_keys()
    assert not [k for k in ir.KEYS if k not in written]


@pytest.mark.parametrize("name", ["gpt", "llama3", "deepseek_v3"])
def test_captured_graphs_carry_only_documented_keys(name):
    cap, _ = captured(name, "tiny", 64)
    for node in cap.graph_module.graph.nodes:
        assert not ir.unknown_keys(node.meta), (node.name, ir.unknown_keys(node.meta))


def test_every_pass_declares_documented_keys():
    assert [p.name for p in PASSES][:1] and len({p.name for p in PASSES}) == len(PASSES)
    for p in PASSES:
        for key in (*p.requires, *p.writes):
            assert key in ir.KEYS, (p.name, key)


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(abs, (x,))
    y.meta["shape"] = (ir.B, ir.S)
    g.output(y)
    return fx.GraphModule({}, g)


def test_a_pass_writing_an_undeclared_key_breaks_its_contract():
    def writer(gm, ctx):
        for n in gm.graph.nodes:
            n.meta["tp"] = "replicated"
        return gm

    run_passes([Pass("declares", writer, lambda ctx: True, writes=("tp",))], _graph(), RewriteContext())
    with pytest.raises(ContractError, match=r"wrote node.meta \['tp'\]"):
        run_passes([Pass("silent", writer, lambda ctx: True)], _graph(), RewriteContext())


def test_a_pass_leaving_an_undocumented_key_or_missing_a_required_one_is_caught():
    def scribble(gm, ctx):
        for n in gm.graph.nodes:
            n.meta["my_private_note"] = 1
        return gm

    with pytest.raises(ContractError, match="undocumented node.meta keys"):
        run_passes(
            [Pass("scribble", scribble, lambda ctx: True, writes=("my_private_note",))], _graph(), RewriteContext()
        )
    with pytest.raises(ContractError, match=r"requires node.meta \['op'\]"):
        run_passes(
            [Pass("needs_op", lambda gm, ctx: gm, lambda ctx: True, requires=("op",))], _graph(), RewriteContext()
        )


def test_a_pass_that_does_not_apply_is_skipped_and_a_failed_fact_is_reported():
    never = Pass("never", lambda gm, ctx: 1 / 0, lambda ctx: ctx.tp > 1)
    run_passes([never], _graph(), RewriteContext(tp=1))
    wrong = Pass("wrong", lambda gm, ctx: gm, lambda ctx: True, ensures=(lambda gm, ctx: "abs is still there",))
    with pytest.raises(ContractError, match="abs is still there"):
        run_passes([wrong], _graph(), RewriteContext())

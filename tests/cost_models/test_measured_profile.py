"""Measured profile fields (``collectives``, ``overlap``): validated like the others; absent, every
cost is today's; present, the cost model reads them (comm per collective; the hidden part of each
kind of communication scaled by its share), and the search's bounds stay lower bounds."""

from dataclasses import replace

import pytest

from autoshard.cost_models import comm, hardware
from autoshard.cost_models.comm import Placement, Where
from autoshard.cost_models.layers import LayerCosts
from autoshard.errors import AutoshardError
from autoshard.planner import Problem
from autoshard.planner.candidates import parse_force
from autoshard.planner.search import Planner
from tests.planner import test_search

from conftest import captured
from conftest import extended_profile as _profile

SEQ = 8192


@pytest.mark.parametrize(
    "body,message",
    [
        ("overlap = { dp = 1.5 }", "'overlap.dp' is a share, at most 1"),
        ("overlap = { dq = 0.5 }", "overlap lists unknown kind 'dq'"),
        ("overlap = { tp = -0.1 }", "'overlap.tp' must be positive"),
        ("overlap = 0.5", "'overlap' must be a table"),
        (
            "collectives = { all_reduce = { gbps = 0, latency_us = 5 } }",
            "'collectives.all_reduce.gbps' must be positive",
        ),
        ("collectives = { all_reduce = { gbps = 5 } }", "collectives.all_reduce must be a table { gbps"),
        ("collectives = { broadcast = { gbps = 5, latency_us = 1 } }", "collectives lists unknown kind 'broadcast'"),
        ("collectives = { send = { gbps = 5, latency_us = -1 } }", "'collectives.send.latency_us' must be positive"),
    ],
)
def test_bad_measured_fields_are_one_line_errors(tmp_path, body, message):
    f = tmp_path / "bad.toml"
    f.write_text(f'name = "bad"\nextends = "h100"\n{body}\n')
    with pytest.raises(AutoshardError, match=message.replace("{", r"\{").replace(".", r"\.")):
        hardware.load(str(f))


def test_absent_fields_change_nothing():
    """Every shipped GPU profile lists neither table: shares 1, collectives at link rate x efficiency."""
    for name in hardware.known():
        hw = hardware.load(name)
        if name == "cpu":
            continue
        assert hw.collectives is None and hw.overlap is None
        assert all(hw.overlap_share(k) == 1 for k in hardware.OVERLAP_KINDS)
        for kind in hardware.COLLECTIVES:
            assert hw.link_rate(kind) == hw.nvlink_gbps * 1e9 * hw.link_efficiency
            assert hw.link_latency_us(kind) == hw.nvlink_latency_us


def test_comm_prices_a_listed_collective_at_its_measured_figures():
    h100 = hardware.load("h100")
    hw = _profile(collectives="{ all_reduce = { gbps = 100, latency_us = 5 }, send = { gbps = 20, latency_us = 50 } }")
    eight, nbytes = Placement(8), 1e8
    assert comm.all_reduce(nbytes, eight, hw) == pytest.approx(2 * 7 / 8 * nbytes / 100e9 + 14 * 5e-6)
    assert comm.p2p(nbytes, 1, hw) == pytest.approx(nbytes / 20e9 + 50e-6)
    # kinds not listed, and the network, keep the profile's link figures; across domains the
    # part inside each domain runs at the measured figure
    assert comm.all_gather(nbytes, eight, hw) == comm.all_gather(nbytes, eight, h100)
    volume = 2 * 15 / 16 * nbytes
    across = max(volume / 8 / (50e9 * 0.8), volume * 7 / 8 / 100e9) + 30 * 10e-6
    assert comm.all_reduce(nbytes, Placement(16), hw) == pytest.approx(across)
    assert comm.p2p(nbytes, 8, hw) == comm.p2p(nbytes, 8, h100)


@pytest.fixture(scope="module")
def analysed():
    return captured("llama3", "8b", SEQ)[1]


def _layer(analysed, hw, tp=1, cp=1, attention="flash"):
    costs = LayerCosts(analysed, SEQ, hw, True)
    one = Where.best(1, hw)
    return costs.layer(0, 1, tp, cp, 1, (), frozenset(), attention, Where.best(tp, hw), Where.best(cp, hw), one, one)


@pytest.mark.parametrize("kind,axes", [("tp", dict(tp=8)), ("cp", dict(cp=4, attention="ring"))])
def test_the_hidden_part_of_tp_and_cp_is_exposed_as_the_share_says(analysed, kind, axes):
    """exposed = exposed as modelled + (1 - share) x hidden; only what stays hidden slows compute."""
    full = _layer(analysed, hardware.load("h100"), **axes)
    exposed, total = getattr(full, kind), getattr(full, f"{kind}_total")
    assert 0 < exposed < total  # the model hides some of it
    for share in (0.0, 0.25):
        layer = _layer(analysed, _profile(overlap=f"{{ {kind} = {share} }}"), **axes)
        assert getattr(layer, kind) == pytest.approx(exposed + (1 - share) * (total - exposed))
        assert getattr(layer, f"{kind}_total") == pytest.approx(total)
        assert layer.interference(False) == pytest.approx(full.interference(False) * share)
        assert layer.time(False) > full.time(False)


def test_the_ep_share_scales_what_an_overlapping_schedule_hides(analysed):
    layer = _layer(analysed, _profile(overlap="{ ep = 0.5 }"))
    assert layer.ep_share == 0.5
    layer = replace(layer, ep=layer.compute / 2)
    hidden = layer.ep  # compute covers the whole all-to-all
    none, half, full = (replace(layer, ep_share=s) for s in (0.0, 0.5, 1.0))
    assert none.time(True) == pytest.approx(none.time(False))
    assert full.time(True) == pytest.approx(full.time(False) - hidden * (1 - full.slowdown))
    assert half.time(True) == pytest.approx(full.time(False) - 0.5 * hidden * (1 - full.slowdown))
    assert half.ep_unhidden == pytest.approx(0.5 * hidden) and full.ep_unhidden == 0


def _best(hw, force: str):
    _, cost = captured("llama3", "small", 128)
    return Planner(Problem(cost, hw, 4, 128, 8, "bf16", parse_force(force)), alternatives=1).run().best


@pytest.mark.parametrize("kind,force", [("dp", "dp=4,tp=1,pp=1,cp=1,zero=0"), ("pp", "pp=2,dp=2,tp=1,cp=1,zero=0")])
def test_dp_and_pp_exposure_follow_their_share(kind, force):
    """On the CPU profile the model hides gradient reduction behind the last backward and the
    steady-state pipeline sends behind compute; a program that hides none of it exposes all."""
    cpu = hardware.load("cpu")
    hides = _best(replace(cpu, overlap={kind: 1.0}), force)
    shows = _best(replace(cpu, overlap={kind: 0.0}), force)
    before, after = hides.breakdown["comm_s"][kind], shows.breakdown["comm_s"][kind]
    assert before["exposed"] < before["total"]
    assert after["exposed"] > before["exposed"]
    if kind == "dp":
        assert after["exposed"] == pytest.approx(after["total"], abs=1e-5)
    assert shows.step_time_s > hides.step_time_s


def test_the_search_finds_the_exhaustive_optimum_with_measured_shares():
    """The bounds stay lower bounds with every share below 1 (DP, TP, CP, PP exposed in part)."""
    overlap = "{ dp = 0.3, tp = 0.5, cp = 0.2, pp = 0.4, ep = 0.1 }"
    test_search.test_search_finds_the_exhaustive_optimum("llama3", 4, 4, {"extends": "h100", "overlap": overlap})


def test_the_family_floor_holds_with_an_unhidden_all_to_all():
    overlap = "{ ep = 0.2, tp = 0.0, cp = 0.5 }"
    test_search.test_family_floor_bounds_every_root_of_the_family(
        "deepseek_v3", "671b", 4096, {"extends": "h800", "overlap": overlap}, 64, 256
    )

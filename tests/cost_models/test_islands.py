"""The price of DiLoCo islands (``cost_models.islands``): the outer all-reduce amortised over H
steps against synchronous DP's gradient reduction over the link between islands, in the plan and
in plan.md."""

import dataclasses
import json

import pytest

from autoshard.cost_models import hardware
from autoshard.cost_models.islands import OUTER_SHARE, choose, price, spanned
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Islands, Plan
from autoshard.report import plan_markdown

from conftest import ROOT


@pytest.fixture(scope="module")
def plan() -> Plan:
    """LLaMA-3 405B on 8192 H100s: TP2 x PP64 x CP8 x DP8, ZeRO-1."""
    return Plan.from_dict(json.loads((ROOT / "tests/golden/llama3_405b_8k_h100.json").read_text())["plan"])


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan") / "h100-wan.toml"
    path.write_text('name = "h100-wan"\nextends = "h100"\nwan_gbps = 0.5\nwan_latency_ms = 20\n')
    return hardware.load(str(path))


def test_the_outer_step_sends_h_times_fewer_bytes_than_synchronous_dp(plan, wan):
    isl = price(plan, wan, Islands(count=2, sync_every=50))
    shard = 4 * plan.model["params"] / (2 * 64) / (4 * 8)  # fp32, a ZeRO-1 rank's rows of its piece
    assert isl.sync_dp_bytes_per_step == pytest.approx(shard)  # a ring over 2 islands sends what it is handed
    assert isl.outer_bytes_per_step == pytest.approx(shard / 50)
    assert isl.sync_dp_s_per_step == pytest.approx(2 * 0.020 + shard / 0.5e9)
    assert isl.outer_s_per_step == pytest.approx(isl.sync_dp_s_per_step / 50)
    four = price(plan, wan, Islands(count=4, sync_every=50))  # more islands: 2(K-1)/K of a larger shard
    assert four.sync_dp_bytes_per_step == pytest.approx(2 * 3 / 4 * 4 * plan.model["params"] / 128 / 16)


def test_zero_0_replicas_share_the_outer_all_reduce(plan, wan):
    """At ZeRO-0 the island's replicas hold the same piece; each syncs its share of it, so the
    saving is H as at ZeRO-1."""
    isl = price(dataclasses.replace(plan, zero_stage=0), wan, Islands(count=2, sync_every=50))
    assert isl.sync_dp_bytes_per_step / isl.outer_bytes_per_step == pytest.approx(50)


def test_without_a_wan_the_network_is_priced(plan):
    h100 = hardware.load("h100")
    isl = price(plan, h100, Islands(count=2, sync_every=10))
    assert "no link between islands" in isl.link
    assert isl.sync_dp_s_per_step == pytest.approx(
        2 * h100.network_latency_us * 1e-6
        + isl.sync_dp_bytes_per_step / (h100.network_gbps * 1e9 * h100.link_efficiency)
    )


def test_islands_round_trip_and_show_in_plan_md(plan, wan):
    with_islands = dataclasses.replace(plan, islands=price(plan, wan, Islands(count=2, sync_every=50)))
    again = Plan.from_dict(json.loads(with_islands.to_json()))
    assert again.islands == with_islands.islands
    md = plan_markdown(again)
    assert "## Islands (DiLoCo)" in md and "50.0x fewer bytes" in md and "| saved |" in md
    assert "## Islands" not in plan_markdown(plan)
    with pytest.raises(AutoshardError, match="islands.count 3 does not divide dp = 8"):
        Plan.from_dict({**json.loads(with_islands.to_json()), "islands": {"count": 3}})


def test_a_negative_wan_is_refused(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('name = "bad"\nextends = "h100"\nwan_gbps = -1\n')
    with pytest.raises(AutoshardError, match="wan_gbps"):
        hardware.load(str(path))


def test_a_slow_link_between_islands_picks_diloco_with_the_fewest_steps_between_syncs(plan, tmp_path):
    """Synchronous DP over a 0.01 GB/s link (40 s for a ZeRO-1 rank's 0.4 GB of gradients) takes
    longer than the step's compute (7.8 s): islands, with H the fewest steps that keep the
    amortised outer step within 5% of the 8.9 s step."""
    path = tmp_path / "slow.toml"
    path.write_text('name = "slow"\nextends = "h100"\nwan_gbps = 0.01\nwan_latency_ms = 20\nwan_island_gpus = 4096\n')
    wan = hardware.load(str(path))
    chosen, why = choose(plan, wan, 2)
    step = plan.predicted.step_time_s
    assert chosen is not None and "DiLoCo islands" in why
    assert chosen.sync_dp_s_per_step > plan.predicted.compute_s
    once = price(plan, wan, Islands(count=2, sync_every=1)).outer_s_per_step
    assert chosen.outer_s_per_step <= OUTER_SHARE * step < once / (chosen.sync_every - 1)
    assert choose(plan, wan, 2, sync_every=7)[0].sync_every == 7  # the user's H, where given


def test_a_link_whose_traffic_hides_behind_compute_keeps_synchronous_dp(plan, wan):
    """0.5 GB/s: 0.8 s of gradient reduction per step behind 7.8 s of compute."""
    chosen, why = choose(plan, wan, 2)
    assert chosen is None and "fits behind the step's compute" in why


def test_a_fast_link_keeps_synchronous_dp(plan, tmp_path):
    path = tmp_path / "fast.toml"
    path.write_text('name = "fast"\nextends = "h100"\nwan_gbps = 50\nwan_latency_ms = 0.01\nwan_island_gpus = 4096\n')
    fast = hardware.load(str(path))
    chosen, why = choose(plan, fast, 2)
    assert chosen is None and "fits behind the step's compute" in why
    assert spanned(fast, 8192) == 2 and spanned(fast, 4096) == 1 and spanned(hardware.load("h100"), 8192) == 1

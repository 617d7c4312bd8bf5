"""A checkpointed MoE layer replays its forward's expert exchanges when its recomputation reads
what they carry: recomputing every kind sends the tokens to the experts and back once more (half
again the layer's expert-parallel bytes: measured at full scale, DeepSeek-V3 671B's DualPipeV
ranks under full recomputation exchanged 1.50 and 1.54 of the bytes planned before the model
counted it), while a set that keeps the experts' inputs and outputs replays neither."""

import pytest

from autoshard.cost_models import hardware
from autoshard.cost_models.layers import LayerCosts

from conftest import captured

SEQ = 64


@pytest.fixture(scope="module")
def moe():
    model = captured("deepseek_v3", "tiny", SEQ)[1]
    kind = next(i for i, b in enumerate(model.blocks) if any(c.axis == "ep" for c in b.collectives))
    return model, kind


@pytest.fixture(scope="module")
def loop():
    from pathlib import Path

    from autoshard.capture import capture_file
    from autoshard.cost_models.analyze import analyze

    model = analyze(capture_file(str(Path(__file__).parents[1] / "models" / "naive_moe.py"), "tiny", SEQ))
    kind = next(i for i, b in enumerate(model.blocks) if any(c.kind == "weights" for c in b.collectives))
    return model, kind


def _ep(costs, kind, recompute, fp8=(), ep=4):
    payload = costs.payload(kind, 1, 1, 1, ep, "flash", fp8, recompute)
    return dict(((a, k), n) for a, k, n in payload)[("ep", "all_to_all")]


def test_full_recomputation_replays_dispatch_and_combine(moe):
    model, kind = moe
    blk = model.blocks[kind]
    every = frozenset(blk.categories)
    assert blk.replayed_exchanges(every) == ((True, True),)
    assert blk.replayed_exchanges(frozenset()) == ((False, False),)
    costs = LayerCosts(model, SEQ, hardware.load("h800"), False)
    assert _ep(costs, kind, every) == pytest.approx(1.5 * _ep(costs, kind, frozenset()))
    # in FP8 the dispatch goes in FP8, the combine in bf16: the replay is one of each
    plain, fp8 = _ep(costs, kind, frozenset(), ("experts",)), _ep(costs, kind, every, ("experts",))
    assert fp8 - plain == pytest.approx(plain / 2)
    assert costs.replayed_payload(kind, 1, 1, 1, 1, (), every) == ()  # nothing exchanged without EP


def test_keeping_the_experts_inputs_replays_no_dispatch(moe):
    model, kind = moe
    blk = model.blocks[kind]
    assert blk.replayed_exchanges(frozenset({"attention"})) == ((False, False),)
    assert blk.replayed_exchanges(frozenset({"experts"}))[0][0]  # the experts' inputs are the dispatched tokens
    for dropped in ({"norm_input"}, {"norm_output"}, {"linear_output"}, {"attention"}):
        assert not blk.replayed_exchanges(frozenset(dropped))[0][0], dropped


def test_a_split_backward_replays_them_again(moe):
    """The layer's time counts its replayed exchanges, and a split backward's weight pass, which
    recomputes the layer a second time, replays them again (``_rerun_in_weight_pass``)."""
    from autoshard.planner.candidates import Candidate
    from autoshard.planner.costs import _rerun_in_weight_pass, placements

    model, kind = moe
    h800 = hardware.load("h800")
    costs = LayerCosts(model, SEQ, h800, False)
    every = frozenset(model.blocks[kind].categories)
    where = placements(Candidate(1, 1, 1, 4, 4, 1, (), "flash", frozenset()), ("tp", "dp", "cp", "pp"), h800)
    at = (where["tp"], where["cp"], where["ep"], where["pp"])
    plain = costs.layer(kind, 1, 1, 1, 4, (), frozenset(), "flash", *at)
    full = costs.layer(kind, 1, 1, 1, 4, (), every, "flash", *at)
    assert plain.ep_replay == 0 and full.ep_replay > 0
    assert full.ep == pytest.approx(plain.ep + full.ep_replay)
    split = _rerun_in_weight_pass(full, 0.5)
    assert split.ep == pytest.approx(full.ep + 0.5 * full.ep_replay)
    assert split.ep_replay == pytest.approx(1.5 * full.ep_replay)


def test_a_loop_of_experts_exchanges_its_stacked_weights(loop):
    """Experts written as a loop over an ``nn.ModuleList`` run grouped over the stack of their own
    parameters; EP keeps ``1/ep`` of every expert parameter's rows on each rank and exchanges them
    into its experts' whole weights, forward, and their gradients back: per layer and
    micro-batch, twice the stack's bytes over ep, beside the routed tokens' exchanges."""
    model, kind = loop
    stacks = [c for c in model.blocks[kind].collectives if c.kind == "weights"]
    assert len(stacks) == 2  # up and down projections: 4 experts of (96, 64) and (64, 96)
    assert [int(c.elems) for c in stacks] == [4 * 96 * 64, 4 * 64 * 96]
    costs = LayerCosts(model, SEQ, hardware.load("h800"), False)
    tokens = 2 * 2 * (2 * 2 * SEQ * 2 * 64)  # dispatch + combine, forward and backward, 2 bytes each
    for ep in (2, 4):
        sent = dict(((a, k), n) for a, k, n in costs.payload(kind, 2, 1, 1, ep, "flash", (), frozenset()))
        assert sent[("ep", "all_to_all")] == pytest.approx(tokens + sum(2 * 2 * int(c.elems) / ep for c in stacks))


def test_every_recomputation_exchanges_a_loops_stacked_weights_again(loop):
    """The experts' GEMMs save the whole weights the exchange made, and the checkpoint remakes
    what its layer saved by running the layer again: a recomputation that keeps the experts
    (dropping only the norms' outputs) dispatches no token again but exchanges every stack once
    more (at full scale, a loop of experts at ZeRO-3 recomputing ``norm_output`` sent 1.25 of
    the planned expert-parallel bytes before the model counted it)."""
    model, kind = loop
    blk = model.blocks[kind]
    stacked = [c.kind == "weights" for c in blk.collectives if c.axis == "ep"]
    assert stacked == [False, True, True]  # the routed tokens, then the two stacks
    norms = frozenset({"norm_output"})
    assert [again for again, _ in blk.replayed_exchanges(norms)] == stacked
    assert [again for again, _ in blk.replayed_exchanges(frozenset())] == [False] * 3
    costs = LayerCosts(model, SEQ, hardware.load("h800"), False)
    stacks = sum(2 * int(c.elems) for c in blk.collectives if c.kind == "weights")  # bytes, bf16
    for ep in (2, 4):
        plain, replayed = _ep(costs, kind, frozenset(), ep=ep), _ep(costs, kind, norms, ep=ep)
        assert replayed - plain == pytest.approx(stacks / ep)

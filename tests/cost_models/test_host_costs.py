"""What a host's own costs add to a layer (CPU runs): each traced op's host time, ranks sharing
the host's cores, a slower attention backward; and none of it on a GPU profile."""

from dataclasses import replace

import pytest

from autoshard.cost_models import hardware
from autoshard.cost_models.layers import LayerCosts

from conftest import captured

SEQ = 64
CPU = replace(hardware.load("cpu"), op_overhead_us=10.0, cores=2)


@pytest.fixture(scope="module")
def analysed():
    return captured("llama3", "tiny", SEQ)[1]


def test_gpu_profiles_share_nothing_and_pay_no_op_overhead():
    for name in hardware.known():
        hw = hardware.load(name)
        if name != "cpu":
            assert hw.op_overhead_us == 0 and hw.cores == 0
        assert hw.shared(4096) is hw or hw.cores


def test_ranks_beyond_the_cores_divide_compute():
    assert CPU.sharing(1) == CPU.sharing(2) == 1
    four = CPU.shared(4)
    assert four.peak_flops("bf16") == pytest.approx(CPU.peak_flops("bf16") / 2)
    assert four.hbm_gbps == pytest.approx(CPU.hbm_gbps / 2)
    assert four.op_overhead_us == pytest.approx(2 * CPU.op_overhead_us)
    assert four.nvlink_gbps == CPU.nvlink_gbps  # links are the communication model's
    assert CPU.sharing(64) == CPU.nvlink_domain / CPU.cores  # ranks on one host only


def test_time_sliced_ranks_share_the_oversubscribed_work():
    """Ranks up to the (rounded) cores share by ``cores``; beyond them by the measured
    ``oversubscribed_cores``; attention's time per score slows with the rest of the compute."""
    hw = replace(CPU, cores=1.9, oversubscribed_cores=1.6, attention_score_ns=1.0, attention_backward_score_ns=3.0)
    assert hw.sharing(2) == pytest.approx(2 / 1.9)  # two ranks on two CPUs: no time-slicing
    assert hw.sharing(4) == pytest.approx(4 / 1.6)
    assert replace(hw, oversubscribed_cores=0.0).sharing(4) == pytest.approx(4 / 1.9)
    four = hw.shared(4)
    assert four.attention_score_ns == pytest.approx(4 / 1.6)
    assert four.attention_backward_score_ns == pytest.approx(3 * 4 / 1.6)


def test_each_traced_op_costs_once_forward_twice_backward(analysed):
    plain = LayerCosts(analysed, SEQ, replace(CPU, op_overhead_us=0.0), False)
    costed = LayerCosts(analysed, SEQ, CPU, False)
    ops = sum(n.op in ("call_function", "call_method", "call_module") for n in analysed.blocks[0]._nodes)
    assert ops > 10
    f0, b0, *_ = plain.compute(0, 1, 1, 1, (), frozenset())
    f1, b1, *_ = costed.compute(0, 1, 1, 1, (), frozenset())
    assert f1 - f0 == pytest.approx(ops * 10e-6)
    assert b1 - b0 == pytest.approx(2 * ops * 10e-6)
    # the search's floor leaves the constant out (it stays proportional to the micro-batch)
    floor = LayerCosts(analysed, SEQ, CPU, False, floor=True)
    assert floor.op_overhead(0) == 0.0


def test_selective_checkpointing_costs_host_time_per_op(analysed):
    """A recomputed layer pays ``checkpoint_op_overhead_us`` per traced op, in its recompute
    time; a layer that recomputes nothing, and the search's floor, pay none."""
    hw = replace(CPU, checkpoint_op_overhead_us=20.0)
    plain, costed = LayerCosts(analysed, SEQ, CPU, False), LayerCosts(analysed, SEQ, hw, False)
    ops = plain._ops(0)
    kinds = frozenset({"activation"})
    assert costed.compute(0, 1, 1, 1, (), kinds)[3] - plain.compute(0, 1, 1, 1, (), kinds)[3] == pytest.approx(
        ops * 20e-6
    )
    assert costed.compute(0, 1, 1, 1, (), frozenset()) == plain.compute(0, 1, 1, 1, (), frozenset())
    # recomputing every category it has, a layer keeps nothing: plain checkpointing, unless TP
    # collectives run inside it (the policy keeps their outputs)
    full = frozenset(analysed.blocks[0].categories)
    assert costed.compute(0, 1, 1, 1, (), full)[3] == plain.compute(0, 1, 1, 1, (), full)[3]
    assert costed.compute(0, 1, 2, 1, (), full)[3] - plain.compute(0, 1, 2, 1, (), full)[3] == pytest.approx(
        ops * 20e-6
    )
    floor = LayerCosts(analysed, SEQ, hw, False, floor=True)
    assert (
        floor.compute(0, 1, 1, 1, (), kinds)[3]
        == LayerCosts(analysed, SEQ, CPU, False, floor=True).compute(0, 1, 1, 1, (), kinds)[3]
    )
    assert hw.shared(4).checkpoint_op_overhead_us == pytest.approx(40.0)


def test_attention_backward_ratio_is_the_profiles(analysed):
    base = LayerCosts(analysed, SEQ, CPU, False)
    slow = LayerCosts(analysed, SEQ, replace(CPU, attention_backward=5.0), False)
    attn = base._rest(0, 1, 1, 1)[0]
    assert attn > 0
    b0 = base.compute(0, 1, 1, 1, (), frozenset())[1]
    b1 = slow.compute(0, 1, 1, 1, (), frozenset())[1]
    assert b1 - b0 == pytest.approx((5.0 - 2.5) * attn)


def test_the_backward_half_length_is_the_profiles(analysed):
    """Without its own half length the backward is ``attention_backward`` times the forward at
    every length; with one, short sequences slow the backward by (keys + half) / keys."""
    base = LayerCosts(analysed, SEQ, CPU, False)
    attn = base._rest(0, 1, 1, 1)[0]
    assert base._attention_backward(0, 1, 1, 1) == pytest.approx(CPU.attention_backward * attn)
    own = replace(CPU, attention_backward_half_length=1000.0)
    slow = LayerCosts(analysed, SEQ, own, False)
    flat = attn * SEQ / (SEQ + CPU.attention_half_length)  # the forward at its long-length rate
    assert slow._attention_backward(0, 1, 1, 1) == pytest.approx(CPU.attention_backward * flat * (SEQ + 1000) / SEQ)


def test_memory_bound_ops_run_at_the_profiles_share_of_the_bandwidth(analysed):
    full = LayerCosts(analysed, SEQ, CPU, False)
    half = LayerCosts(analysed, SEQ, replace(CPU, pointwise_efficiency=0.5), False)
    assert half._rest(0, 1, 1, 1)[1] == pytest.approx(2 * full._rest(0, 1, 1, 1)[1])
    assert half._rest(0, 1, 1, 1)[0] == full._rest(0, 1, 1, 1)[0]  # attention is not memory-bound here


def test_the_softmax_costs_per_score_beside_the_matmuls(analysed):
    """``attention_score_ns`` adds its time per score (1 / (2 (d + dv)) per attention FLOP) to
    the attention's, forward and backward, at the same length factor."""
    blk = analysed.blocks[0]
    head = 2 * (2 * 16)  # llama3 tiny: head dim 16 for q, k and v
    assert blk.scores_per_attention_flop == pytest.approx(1 / head)
    base = LayerCosts(analysed, SEQ, CPU, False)
    scored = LayerCosts(analysed, SEQ, replace(CPU, attention_score_ns=3.0, attention_backward_score_ns=5.0), False)
    flops = base._attention_flops(blk, 1, 1, 1)
    length = (SEQ + CPU.attention_half_length) / SEQ
    assert scored._attention(0, 1, 1, 1) - base._attention(0, 1, 1, 1) == pytest.approx(flops / head * 3e-9 * length)
    extra = scored._attention_backward(0, 1, 1, 1) - base._attention_backward(0, 1, 1, 1)
    assert extra == pytest.approx(flops / head * 5e-9 * length)


def _pinned(hw, zero: int):
    from autoshard import planner

    cost = captured("llama3", "tiny", SEQ)[1]
    problem = planner.Problem(cost, hw, 4, SEQ, 8, "bf16", {"dp": 4, "zero": zero, "microbatches": 2}, "tiny")
    return planner.solve(problem)[0].predicted


@pytest.mark.parametrize("zero", [1, 3])
def test_fsdp_units_cost_host_time_per_micro_batch_at_zero_2_and_3(zero):
    """At ZeRO-2/3 each FSDP2 unit (a layer, the embedding, the head) pays the profile's host
    time per micro-batch, in the step and in its compute; ZeRO-1 runs no FSDP2."""
    base = replace(CPU, cores=0.0)
    plain, costed = _pinned(base, zero), _pinned(replace(base, fsdp_unit_overhead_us=1000.0), zero)
    units = captured("llama3", "tiny", SEQ)[1].blocks[0].count + 2
    added = 2 * units * 1e-3 if zero == 3 else 0.0
    assert costed.step_time_s - plain.step_time_s == pytest.approx(added, rel=1e-6, abs=1e-9)
    assert costed.compute_s - plain.compute_s == pytest.approx(added, rel=1e-6, abs=1e-9)


def test_blocking_collectives_wait_where_ranks_are_time_sliced(analysed):
    """Each TP collective of a layer costs ``blocking_wait_us`` more where the ranks outnumber
    the CPUs (the partner must first get a core), nothing where each rank has a CPU."""
    from autoshard.cost_models.comm import Where

    hw = replace(CPU, cores=1.9, blocking_wait_us=500.0)
    assert hw.shared(2).blocking_wait_us == 0.0 and hw.shared(4).blocking_wait_us == 500.0
    one = Where.best(1, CPU)
    tp2 = Where.best(2, CPU)

    def tp_time(profile):
        layers = LayerCosts(analysed, SEQ, profile, False)
        return layers.comm(0, 1, 2, 1, 1, "ring", (), tp2, one, one)[0]

    count = sum(c.axis == "tp" for c in analysed.blocks[0].collectives)
    assert count > 0
    waiting, plain = hw.shared(4), replace(hw.shared(4), blocking_wait_us=0.0)
    assert tp_time(waiting) - tp_time(plain) == pytest.approx(count * 500e-6)
    assert tp_time(hw.shared(2)) == tp_time(replace(hw.shared(2), blocking_wait_us=0.0))

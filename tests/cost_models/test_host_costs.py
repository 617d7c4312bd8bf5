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


def test_attention_backward_ratio_is_the_profiles(analysed):
    base = LayerCosts(analysed, SEQ, CPU, False)
    slow = LayerCosts(analysed, SEQ, replace(CPU, attention_backward=5.0), False)
    attn = base._rest(0, 1, 1, 1)[0]
    assert attn > 0
    b0 = base.compute(0, 1, 1, 1, (), frozenset())[1]
    b1 = slow.compute(0, 1, 1, 1, (), frozenset())[1]
    assert b1 - b0 == pytest.approx((5.0 - 2.5) * attn)

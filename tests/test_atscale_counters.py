"""The counters ``verify --at-scale`` reads: memory by part, bytes per collective, FLOPs of the ops
torch's counter does not know, and which ranks it chooses."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoshard import atscale
from autoshard.cost_models.comm import wire_bytes
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Mesh
from autoshard.runtime import attention  # noqa: F401 (registers the flash-attention ops)


def test_memory_counter_files_parameters_gradients_optimizer_states_and_activations():
    with FakeTensorMode():
        model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(), nn.Linear(512, 256, bias=False))
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 256)
        counter = atscale.MemoryCounter()
        counter.hold([model], [opt])
        params = 4 * (256 * 512 + 512 * 256)
        assert counter.live["params"] == params
        with counter:
            model(x).sum().backward()
            after_backward = dict(counter.live)
            opt.step()
        counter.release()
    assert after_backward["grads"] == params  # each gradient as it accumulated
    # AdamW's two moments and its step count (a 4-byte tensor per parameter), made in its step
    assert counter.live["optimizer"] == 2 * params + 4 * 2
    # what the forward kept for backward: the ReLU's output and the second product's input (one
    # storage), gone once backward ran
    assert counter.part_peaks["activations"] >= 4 * 64 * 512
    assert after_backward["activations"] == 0
    assert counter.peak >= 2 * params + 4 * 64 * 512


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield
    dist.destroy_process_group()


def test_comm_counter_counts_what_each_collective_hands_over(fake_world):
    group = dist.new_group([0, 1, 2, 3])
    names = {group.group_name: "tp"}
    with FakeTensorMode():
        x = torch.empty(1000, dtype=torch.bfloat16)
        out = torch.empty(4000, dtype=torch.bfloat16)
        with atscale.CommCounter(names) as comm:
            dist.all_reduce(x, group=group)
            dist.all_gather_into_tensor(out, x, group=group)
            dist.reduce_scatter_tensor(x, out, group=group)
    assert comm.bytes[("tp", "all_reduce")] == 2000
    assert comm.bytes[("tp", "all_gather")] == 8000  # the gathered result
    assert comm.bytes[("tp", "reduce_scatter")] == 8000  # the input before scattering
    assert comm.wire["tp"] == pytest.approx(wire_bytes("all_reduce", 2000, 4) + 2 * 0.75 * 8000)


def test_process_groups_are_named_by_the_coordinates_their_ranks_vary_in():
    mesh = Mesh(tp=2, cp=2, pp=2, dp=2, order=["tp", "cp", "pp", "dp"])
    assert [atscale.coordinates(mesh, r)["pp"] for r in (0, 4)] == [0, 1]
    assert atscale.rank_at(mesh, pp=1, dp=1) == 12
    assert atscale._dimension(mesh, [0, 1]) == "tp"
    assert atscale._dimension(mesh, [0, 2, 8, 10]) == "dp"  # dp x cp: ZeRO's group, data parallelism's traffic
    assert atscale._dimension(mesh, [0, 4]) == "pp"
    assert atscale._dimension(mesh, list(range(16))) == "mixed"  # every coordinate varies
    # ZeRO-3 over dp x cp with nothing else split: that group is every rank, and it is dp's
    flat = Mesh(tp=1, cp=2, pp=1, dp=4, order=["tp", "cp", "pp", "dp"])
    assert atscale._dimension(flat, list(range(8))) == "dp"


def _attention_flops(q, k, v, causal):
    with FakeTensorMode():
        q, k, v = (torch.empty(s, dtype=torch.bfloat16, requires_grad=True) for s in (q, k, v))
        with atscale.FlopCounter(display=False, custom_mapping=atscale.flop_formulas()) as counter:
            out, _ = torch.ops.autoshard.flash_attention(q, k, v, causal, 0.125)
            out.sum().backward()
    return counter.get_total_flops()


def test_flash_attention_flops_count_the_causal_pairs_and_the_backward_recomputation():
    b, h, s, d = 2, 4, 256, 64
    full = 4 * b * h * s * s * d  # QK^T and PV
    assert _attention_flops((b, h, s, d), (b, 2, s, d), (b, 2, s, d), False) == pytest.approx(3.5 * full)
    causal = 4 * b * h * (s * (s + 1) // 2) * d
    assert _attention_flops((b, h, s, d), (b, 2, s, d), (b, 2, s, d), True) == pytest.approx(3.5 * causal)


def test_causal_pairs_match_the_mask_when_the_queries_are_the_tail_of_the_keys():
    for sq, sk in [(4, 4), (3, 7), (7, 3), (1, 1), (64, 128)]:
        brute = sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq))
        assert atscale._causal_pairs(sq, sk, True) == brute
        assert atscale._causal_pairs(sq, sk, False) == sq * sk


def test_first_last_and_busiest_ranks_are_chosen_from_the_plan():
    ranks = [{"memory_bytes": {"total": t}} for t in (5.0, 9.0, 7.0, 6.0)]
    plan = SimpleNamespace(
        gpus=16,
        mesh=Mesh(tp=2, cp=1, pp=4, dp=2, order=["tp", "cp", "pp", "dp"]),
        schedule="1f1b",
        virtual_stages=1,
        predicted=SimpleNamespace(ranks=ranks),
    )  # the fields of a Plan that chosen_ranks reads
    assert atscale.chosen_ranks(plan, "first,last,busiest") == {0: ["first"], 6: ["last"], 2: ["busiest"]}
    assert atscale.chosen_ranks(plan, "3,first") == {3: ["asked"], 0: ["first"]}
    with pytest.raises(AutoshardError, match="'biggest' is not first, last, busiest or a rank below 16"):
        atscale.chosen_ranks(plan, "biggest")
    with pytest.raises(AutoshardError, match="a rank below 16"):
        atscale.chosen_ranks(plan, "16")

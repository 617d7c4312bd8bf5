"""The MoE runtime: grouped GEMM against a per-group loop; dispatch -> grouped GEMM -> combine over
2 and 4 gloo ranks against the single-process computation (forward and gradients, uneven counts,
experts and ranks with no tokens, capacity drops); the fixed-capacity buffer form; load balancing
(bias updates identical on every rank, no double count under recomputation, a skewed router
balanced by bias updates alone) and the two auxiliary losses against their formulas."""

import copy
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from autoshard.runtime import moe
from autoshard.runtime.checkpoint import Checkpoint
from autoshard.runtime.groups import set_groups

H, N = 8, 4  # fp32 rows of 32 and 16 bytes: torch._grouped_mm's path on CPU


def _loop(a, b, counts):
    """The reference: one matmul per group."""
    return torch.cat([part @ b[g] for g, part in enumerate(a.split(counts))])


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


# --- grouped GEMM ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, k, n, fast",
    [(torch.float32, 8, 4, True), (torch.float32, 3, 5, False), (torch.bfloat16, 8, 8, True)],
)
def test_grouped_mm_matches_a_loop(dtype, k, n, fast):
    gen = torch.Generator().manual_seed(0)
    counts = [0, 3, 0, 5, 1, 0]
    a = torch.randn(sum(counts), k, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(len(counts), k, n, generator=gen).to(dtype).requires_grad_()
    assert moe.grouped_mm_runs(a, b) is fast
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    out = moe.grouped_mm(a, b, _offs(counts))
    ref = _loop(ref_a, ref_b, counts)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    out.sum().backward()  # an expanded gradient: the trap of _grouped_mm's backward
    ref.sum().backward()
    torch.testing.assert_close(a.grad, ref_a.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(b.grad, ref_b.grad, atol=tol, rtol=tol)


def test_grouped_mm_takes_transposed_weights():
    gen = torch.Generator().manual_seed(1)
    counts = [2, 0, 4]
    a = torch.randn(6, 8, generator=gen)
    stored = torch.randn(3, 4, 8, generator=gen)  # [G, N, K] as nn.Linear-style weights keep them
    out = moe.grouped_mm(a, stored.transpose(-2, -1), _offs(counts))
    torch.testing.assert_close(out, _loop(a, stored.transpose(-2, -1), counts), atol=1e-6, rtol=1e-6)


# --- single process: the computation with no EP group ----------------------------------------------


def _capacity_mask(counts, factor):
    """Which rows an expert keeps under a capacity: its first ceil(factor * S / E)."""
    limit = math.ceil(factor * sum(counts) / len(counts))
    return torch.cat([torch.arange(c) < limit for c in counts]), sum(max(c - limit, 0) for c in counts)


def test_dispatch_and_combine_without_a_group():
    gen = torch.Generator().manual_seed(2)
    counts = [3, 0, 6, 1]
    rows = torch.randn(10, H, generator=gen)
    w = torch.randn(4, H, N, generator=gen)
    local, local_offs, recv = moe.dispatch(rows, _offs(counts))
    assert local is rows and local_offs.tolist() == _offs(counts).tolist() and recv.tolist() == [counts]
    moe.dropped_tokens(reset=True)
    local, local_offs, recv = moe.dispatch(rows, _offs(counts), capacity_factor=1.0)
    out = moe.combine(moe.grouped_mm(local, w, local_offs), _offs(counts), recv, capacity_factor=1.0)
    keep, dropped = _capacity_mask(counts, 1.0)
    assert dropped == 3 and moe.dropped_tokens(reset=True) == dropped and moe.dropped_tokens() == 0
    torch.testing.assert_close(out, _loop(rows, w, counts) * keep[:, None], atol=1e-6, rtol=1e-6)


# --- gloo ranks ------------------------------------------------------------------------------------


def _data(world, experts, ep):
    """Every rank's routed rows (sorted by expert) with uneven counts: expert 1 gets no token from
    anyone, rank 0 sends nothing to the last EP rank of its group, and on 4 ranks rank 3 routes none."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(1, 5, (world, experts), generator=gen)
    counts[:, 1] = 0
    counts[0, experts - experts // ep :] = 0
    if world == 4:
        counts[3] = 0
    rows = [torch.randn(int(c.sum()), H, generator=gen) for c in counts]
    grads = [torch.randn(int(c.sum()), N, generator=gen) for c in counts]
    weight = torch.randn(experts, H, N, generator=gen)
    return [c.tolist() for c in counts], rows, grads, weight


def _set_ep(world, ep):
    """EP groups of ``ep`` consecutive ranks, EDP groups of equal positions; route = every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    edp_groups = [dist.new_group(list(range(p, world, ep))) for p in range(ep)]
    set_groups(ep=ep_groups[rank // ep], edp=edp_groups[rank % ep], route=dist.group.WORLD)
    return rank // ep * ep  # the first rank of this rank's EP group


def _moe_errors(rank, world, ep, experts, factor):
    """Max differences of dispatch -> grouped_mm -> combine against one process running every
    rank of this EP group: the output, the rows' gradient and the local experts' weight gradient."""
    first = _set_ep(world, ep)
    counts, rows, grads, weight = _data(world, experts, ep)
    members = range(first, first + ep)
    ones = {r: (torch.ones(len(rows[r]), dtype=torch.bool), 0) for r in members}
    masks = {r: _capacity_mask(counts[r], factor) for r in members} if factor else ones
    ref_rows = {r: rows[r].clone().requires_grad_() for r in members}
    ref_w = weight.clone().requires_grad_()
    refs = {r: _loop(ref_rows[r], ref_w, counts[r]) * masks[r][0][:, None] for r in members}
    sum((refs[r] * grads[r]).sum() for r in members).backward()
    held = slice((rank - first) * experts // ep, (rank - first + 1) * experts // ep)
    limits = {r: math.ceil(factor * len(rows[r]) / experts) if factor else len(rows[r]) for r in members}
    expected_recv = torch.tensor([[min(c, limits[r]) for c in counts[r][held]] for r in members])
    mine = rows[rank].clone().requires_grad_()
    w = weight[held].clone().requires_grad_()
    offs = _offs(counts[rank])
    moe.dropped_tokens(reset=True)
    sent, local_offs, recv = moe.dispatch(mine, offs, capacity_factor=factor)
    out = moe.combine(moe.grouped_mm(sent, w, local_offs), offs, recv, capacity_factor=factor)
    (out * grads[rank]).sum().backward()
    empty = len(out) == 0  # a rank that routed no token
    return {
        "forward": 0.0 if empty else (out - refs[rank]).abs().max().item(),
        "rows_grad": 0.0 if empty else (mine.grad - ref_rows[rank].grad).abs().max().item(),
        "weight_grad": (w.grad - ref_w.grad[held]).abs().max().item(),
        "recv_counts": (recv - expected_recv).abs().max().item(),
        "local_offs": (local_offs - expected_recv.sum(0).cumsum(0)).abs().max().item(),
        "dropped": moe.dropped_tokens(reset=True) - masks[rank][1],
    }


def _buffer_errors(rank, world, ep, experts):
    """The [E, C, H] buffer form: layout, round trip, and per-expert bmm against one process."""
    first = _set_ep(world, ep)
    gen = torch.Generator().manual_seed(4)
    slots, local = 3, experts // ep
    bufs = [torch.randn(experts, slots, H, generator=gen) for _ in range(world)]
    grads = [torch.randn(experts, slots, N, generator=gen) for _ in range(world)]
    weight = torch.randn(experts, H, N, generator=gen)
    mine_w = slice((rank - first) * local, (rank - first + 1) * local)
    ref_w = weight.clone().requires_grad_()
    ref_bufs = {r: bufs[r].clone().requires_grad_() for r in range(first, first + ep)}
    sum((torch.bmm(b, ref_w) * grads[r]).sum() for r, b in ref_bufs.items()).backward()
    buf = bufs[rank].clone().requires_grad_()
    w = weight[mine_w].clone().requires_grad_()
    sent = moe.dispatch_buffer(buf)
    expected = torch.cat([bufs[r][mine_w] for r in range(first, first + ep)], dim=1)
    out = moe.combine_buffer(torch.bmm(sent, w))
    (out * grads[rank]).sum().backward()
    return {
        "layout": (sent - expected).abs().max().item(),
        "round_trip": (moe.combine_buffer(sent) - bufs[rank]).abs().max().item(),
        "forward": (out - torch.bmm(bufs[rank], weight)).abs().max().item(),
        "buf_grad": (buf.grad - ref_bufs[rank].grad).abs().max().item(),
        "weight_grad": (w.grad - ref_w.grad[mine_w]).abs().max().item(),
    }


def _bias_after_update(rank, world, experts):
    """Each rank records its own loads; returns (bias after update_biases, the log, every rank's loads)."""
    gen = torch.Generator().manual_seed(5)
    picks = [torch.randint(0, experts, (6 + r, 2), generator=gen) for r in range(world)]
    bias = torch.zeros(experts)
    moe.record_load(picks[rank], experts, "layers.1.moe")
    log = moe.update_biases({"layers.1.moe": bias}, gamma=0.5)
    total = sum(torch.bincount(p.reshape(-1), minlength=experts) for p in picks)
    return bias, log["layers.1.moe"], total, moe.expert_loads()


def _worker(rank, world, cases):
    results = {}
    for ep, experts in cases:
        results[f"ep{ep}, dropless"] = _moe_errors(rank, world, ep, experts, None)
        results[f"ep{ep}, capacity"] = _moe_errors(rank, world, ep, experts, 0.75)
        results[f"ep{ep}, buffer"] = _buffer_errors(rank, world, ep, experts)
    return results, _bias_after_update(rank, world, cases[0][1])


@pytest.mark.parametrize("world, cases", [(2, [(2, 6)]), (4, [(4, 8), (2, 8)])])
def test_expert_parallel_matches_one_process(world, cases):
    """(ep, experts) cases; on 4 ranks ep=2 makes two EP groups, each checked against its own ranks."""
    from distributed import run

    results = run(_worker, world, cases, timeout=60)
    for errors, _ in results:
        for case, errs in errors.items():
            for name, err in errs.items():
                assert abs(err) < 1e-6, f"{case} {name}: {err}"
    biases = [bias for _, (bias, *_) in results]
    _, (mx, mean), total, left = results[0][1]
    assert all(torch.equal(b, biases[0]) for b in biases)  # every replica takes the same step
    assert torch.equal(biases[0], 0.5 * torch.sign(total.double().mean() - total).float())
    assert (mx, mean) == (float(total.max()), float(total.double().mean())) and left == {}


# --- load balancing in one process -----------------------------------------------------------------


@pytest.mark.parametrize("wrap", ["plain", "checkpoint", "selective"])
def test_record_load_counts_once_under_recomputation(wrap):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3, generator=gen, requires_grad=True)
    weight = torch.randn(3, 4, generator=gen)
    runs = []

    def layer(x):
        runs.append(1)
        scores = torch.sigmoid(x @ weight)
        indices = moe.record_load(scores.topk(2, dim=-1).indices, 4, "layer")
        return scores.gather(1, indices).sum()

    fn = {
        "plain": layer,
        "checkpoint": lambda x: checkpoint(layer, x, use_reentrant=False),
        "selective": Checkpoint(layer, recompute=["activation"]),  # keeps matmuls, recomputes sigmoid
    }[wrap]
    moe.update_biases({})  # drop loads other tests left
    fn(x).backward()
    fn(x).backward()
    assert len(runs) == (2 if wrap == "plain" else 4)  # checkpointed: run again in each backward
    chosen = torch.sigmoid(x.detach() @ weight).topk(2, dim=-1).indices
    assert torch.equal(moe.expert_loads()["layer"], 2 * torch.bincount(chosen.reshape(-1), minlength=4))


def test_update_biases_follows_the_sign_rule():
    moe.update_biases({})
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0])
    moe.record_load(torch.tensor([[0, 0], [0, 2], [1, 2]]), 4, "a")  # loads 3, 1, 2, 0: mean 1.5
    log = moe.update_biases({"a": bias, "b": torch.zeros(2)}, gamma=0.01)
    torch.testing.assert_close(bias, torch.tensor([0.09, 0.01, -0.21, 0.01]))
    assert log == {"a": (3.0, 1.5), "b": (0.0, 0.0)} and moe.expert_loads() == {}


def test_sequence_balance_loss_is_deepseek_v3s_formula():
    gen = torch.Generator().manual_seed(7)
    experts, k, seq, batch, alpha = 5, 2, 4, 3, 0.01
    scores = torch.rand(batch * seq, experts, generator=gen)
    indices = scores.topk(k, dim=-1).indices
    per_sequence = []
    for b in range(batch):
        s, chosen = scores[b * seq : (b + 1) * seq], indices[b * seq : (b + 1) * seq]
        total = 0.0
        for i in range(experts):
            f = experts / (k * seq) * (chosen == i).sum().item()
            p = sum((s[t, i] / s[t].sum()).item() for t in range(seq)) / seq
            total += f * p
        per_sequence.append(alpha * total)
    loss = moe.sequence_balance_loss(scores, indices, experts, seq, alpha)
    assert abs(loss.item() - sum(per_sequence) / batch) < 1e-7


def test_switch_aux_loss_is_switch_transformers_formula():
    gen = torch.Generator().manual_seed(8)
    experts, alpha = 4, 0.01
    probs = torch.softmax(torch.randn(6, experts, generator=gen), dim=-1)
    indices = probs.topk(1, dim=-1).indices
    f = [(indices == i).float().mean().item() for i in range(experts)]
    p = [probs[:, i].mean().item() for i in range(experts)]
    expected = alpha * experts * sum(fi * pi for fi, pi in zip(f, p))
    assert abs(moe.switch_aux_loss(probs, indices, experts, alpha).item() - expected) < 1e-7


def test_bias_updates_alone_balance_a_skewed_router():
    """The bundled DeepSeek-V3's MoE (8 experts in 2 groups, top-2 from the best group) with a gate
    skewed so experts 0 and 1 win every token (max/mean load 3.9): bias updates at the default
    gamma 1e-3, no gradient step, bring max/mean load under 1.3 within 200 steps and keep it there.
    The bias moves selection only: the layer's output equals the unbiased layer's on the same
    selection (gates from the unbiased scores)."""
    import deepseek_v3

    torch.manual_seed(0)
    cfg = deepseek_v3.CONFIGS["tiny"]
    layer = deepseek_v3.MoE(cfg)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, cfg.hidden, generator=gen)
    direction = x.mean(0) / x.mean(0).norm()
    x = x + 2.0 * direction
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.02, generator=gen)
        layer.gate.weight[[0, 1]] += 0.3 * direction
    moe.update_biases({})
    imbalance = []
    for _ in range(400):
        with torch.no_grad():
            moe.record_load(layer.route(torch.sigmoid(layer.gate(x))), cfg.experts, "ffn")
        high, mean = moe.update_biases({"ffn": layer.expert_bias})["ffn"]
        imbalance.append(high / mean)
    assert imbalance[0] > 3.0
    settled = next(i for i, v in enumerate(imbalance) if v < 1.3)
    assert settled < 200 and max(imbalance[settled:]) < 1.3, (settled, max(imbalance[settled:]))

    with torch.no_grad():
        chosen = layer.route(torch.sigmoid(layer.gate(x)))
        unbiased = copy.deepcopy(layer)
        unbiased.expert_bias.zero_()
        assert not torch.equal(unbiased.route(torch.sigmoid(unbiased.gate(x))), chosen)  # the bias did steer
        unbiased.route = lambda scores: chosen
        torch.testing.assert_close(layer(x), unbiased(x), atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["sequence", "switch"])
def test_a_balance_loss_joins_the_training_loss_where_the_layer_is(kind):
    """``balance_loss`` leaves the rows as they are and adds ``scale`` x the layer's balance loss
    to the gradient, as if it had been added to the training loss."""
    torch.manual_seed(0)
    tokens, hidden, experts, k, seq = 12, 6, 4, 2, 6
    x = torch.randn(tokens, hidden)
    router = torch.randn(hidden, experts, requires_grad=True)
    rows = torch.randn(tokens * k, hidden, requires_grad=True)
    weight = torch.randn(tokens * k, hidden)

    def run(attach: bool):
        router.grad = rows.grad = None
        scores = torch.sigmoid(x @ router)
        chosen = scores.topk(k, dim=-1)[1]
        out = moe.balance_loss(rows, scores, chosen, experts, seq, "layer") if attach else rows
        loss = (out * weight).sum()
        if not attach:
            probs = scores / scores.sum(-1, keepdim=True)
            aux = (
                moe.sequence_balance_loss(scores, chosen, experts, seq, 0.1)
                if kind == "sequence"
                else moe.switch_aux_loss(probs, chosen, experts, 0.1)
            )
            loss = loss + 0.5 * aux
        loss.backward()
        return router.grad.clone(), rows.grad.clone()

    try:
        moe.set_aux_loss(kind, 0.1, scale=0.5)
        attached = run(True)
        moe.set_aux_loss(None)
        explicit = run(False)
    finally:
        moe.set_aux_loss(None)
    assert torch.allclose(attached[0], explicit[0], atol=1e-6)
    assert torch.equal(attached[1], explicit[1])
    assert attached[0].abs().sum() > 0  # the balance loss reached the router
    assert moe.balance_losses()["layer"] > 0


def test_no_balance_loss_by_default_leaves_the_router_gradient_alone():
    scores = torch.rand(4, 4, requires_grad=True)
    rows = torch.randn(8, 3, requires_grad=True)
    out = moe.balance_loss(rows, scores, scores.topk(2)[1], 4, 4, "layer")
    out.sum().backward()
    assert out is rows and scores.grad is None


# --- balance losses under sequence parallelism --------------------------------------------------------


def _sliced_balance_loss(rank, world, kind):
    """This TP rank's term of the balance loss over its slice of each sequence, its gradient, and
    the single-process loss and gradient over whole sequences (the rows of this rank's slice)."""
    import torch.distributed as dist

    seqs, seq, experts, k, alpha = 3, 8, 4, 2, 0.1
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(seqs, seq, experts, generator=gen) + 0.1
    chosen = scores.topk(k, dim=-1)[1]
    local = seq // world
    part = slice(rank * local, (rank + 1) * local)

    def loss(s, c, length, group):
        if kind == "sequence":
            return moe.sequence_balance_loss(s, c, experts, length, alpha, group)
        return moe.switch_aux_loss(s / s.sum(-1, keepdim=True), c, experts, alpha, group)

    whole = scores.reshape(-1, experts).clone().requires_grad_()
    expected = loss(whole, chosen.reshape(-1, k), seq, None)
    expected.backward()
    mine = scores[:, part].reshape(-1, experts).clone().requires_grad_()
    term = loss(mine, chosen[:, part].reshape(-1, k), local, dist.group.WORLD)
    term.backward()
    expected_grad = whole.grad.view(seqs, seq, experts)[:, part].reshape(-1, experts)
    total = term.detach().clone()
    dist.all_reduce(total)
    return total.item(), expected.item(), (mine.grad - expected_grad).abs().max().item()


@pytest.mark.parametrize("kind", ["sequence", "switch"])
def test_balance_loss_terms_over_sequence_slices_sum_to_the_loss(kind):
    """Each TP rank's term over its slice of every sequence: the terms sum to the loss over whole
    sequences and each rank's gradient is the loss's in its scores."""
    from distributed import run

    for total, expected, grad_err in run(_sliced_balance_loss, 2, kind, timeout=60):
        assert abs(total - expected) < 1e-6 * abs(expected) and expected > 0
        assert grad_err < 1e-7

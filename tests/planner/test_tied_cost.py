"""What an embedding tied to the output head costs: the analysis finds the tie in the graph (one
parameter read by the embedding and by the head), counts it once, in the embedding; a pipeline
whose head chunk is not its first holds a second copy there (its model states on the last rank)
and sums the copies' gradients with one all-reduce between the two ends each step. Without a
pipeline nothing is added. Compared with the same model untied and with the tie left out."""

import copy
import dataclasses

import pytest
import torch

from autoshard.capture import capture
from autoshard.cost_models import hardware
from autoshard.cost_models.analyze import analyze
from autoshard.cost_models.comm import pipeline_ends_all_reduce
from autoshard.cost_models.memory import sharded_state_bytes
from autoshard.planner.candidates import Candidate, Problem
from autoshard.planner.costs import CandidateCosts
from autoshard.planner.evaluate import Evaluator

VOCAB, HIDDEN, SEQ = 128, 64, 32
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _cost(tied: bool):
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, tie_word_embeddings=tied))
    return analyze(capture(model, seq=SEQ))


@pytest.fixture(scope="module")
def costs():
    """(tied, untied, tied with the tie fact removed)."""
    tied, untied = _cost(True), _cost(False)
    blind = copy.copy(tied)
    blind.facts = tied.facts | {"tied": {"params": 0, "params_tp": 0}}
    return tied, untied, blind


def _evaluate(cost, pp: int, tp: int = 1, schedule: str = "1f1b", v: int = 1):
    hw = hardware.load("cpu")
    gpus = tp * pp
    problem = Problem(cost, hw, gpus, SEQ, 4)
    c = Candidate(tp, pp, 1, 1, 1, 1, (), "flash", frozenset(), schedule, v, ("tp", "cp", "pp", "dp"), 0)
    costs = CandidateCosts(problem)
    stages = None if pp == 1 else tuple([4 // (pp * v)] * (pp * v))  # one chunk: one split
    ev = Evaluator(costs).evaluate(c, stages)
    assert ev.feasible, ev.reason
    return ev, costs.where(c, True)[1], hw


def test_the_tie_is_a_fact_of_the_graph(costs):
    tied, untied, _ = costs
    assert tied.facts["tied"]["params"] == VOCAB * HIDDEN
    assert untied.facts["tied"] == {"params": 0, "params_tp": 0}
    # counted once, in the embedding: the untied model has the head's own weight more
    assert untied.pre.params == tied.pre.params
    assert untied.post.params - tied.post.params == VOCAB * HIDDEN


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_holds_a_copy_and_sums_its_gradient(costs, tp):
    tied, untied, blind = costs
    ev, where, hw = _evaluate(tied, 2, tp)
    ev_blind, _, _ = _evaluate(blind, 2, tp)
    fact = tied.facts["tied"]
    copy_params = fact["params_tp"] / tp + fact["params"] - fact["params_tp"]
    copy_bytes = sharded_state_bytes(copy_params, 0.0, 0, 1, 1)
    # the head's rank holds the copy's weights, gradients and optimizer states; the first rank is unchanged
    assert ev.memory_ranks[0] == pytest.approx(ev_blind.memory_ranks[0])
    assert ev.memory_ranks[1] - ev_blind.memory_ranks[1] == pytest.approx(copy_bytes["total"])
    # one all-reduce of the copy's gradient between the two ends, exposed in the step
    sync = pipeline_ends_all_reduce(copy_bytes["grads"], where["pp"], hw)
    assert sync > 0
    assert ev.step_time_s - ev_blind.step_time_s == pytest.approx(sync)
    assert ev.breakdown["comm_s"]["pp"]["exposed"] - ev_blind.breakdown["comm_s"]["pp"]["exposed"] == pytest.approx(
        sync
    )
    # the untied model pays no sum: its head's weight is its own
    ev_untied, _, _ = _evaluate(untied, 2, tp)
    assert ev_untied.breakdown["comm_s"]["pp"]["exposed"] < ev.breakdown["comm_s"]["pp"]["exposed"]


def test_v_shaped_pipeline_keeps_both_copies_on_one_rank(costs):
    """zbv puts the first and the last chunk on rank 0: two copies there, summed locally."""
    tied, _, blind = costs
    ev, _, _ = _evaluate(tied, 2, schedule="zbv", v=2)
    ev_blind, _, _ = _evaluate(blind, 2, schedule="zbv", v=2)
    copy_bytes = sharded_state_bytes(float(VOCAB * HIDDEN), 0.0, 0, 1, 1)["total"]
    assert ev.memory_ranks[0] - ev_blind.memory_ranks[0] == pytest.approx(copy_bytes)
    assert ev.step_time_s == pytest.approx(ev_blind.step_time_s)


def test_no_pipeline_no_copy(costs):
    tied, _, blind = costs
    ev, _, _ = _evaluate(tied, 1)
    ev_blind, _, _ = _evaluate(blind, 1)
    assert ev.step_time_s == ev_blind.step_time_s
    assert ev.memory_ranks == ev_blind.memory_ranks
    assert dataclasses.asdict(ev)["breakdown"] == dataclasses.asdict(ev_blind)["breakdown"]

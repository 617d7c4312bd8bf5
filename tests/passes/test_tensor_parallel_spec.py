"""Tensor parallelism as Before/Expected specifications: each test captures a small model (Before),
runs the pass at tp=2 and compares the result with the program one rank must run (Expected),
written out as an ``nn.Module`` whose submodules have the local shapes."""

import torch
import torch.nn.functional as F
from spec import LM, assert_same_program, before, call, program
from torch import nn

from autoshard.passes.contract import RewriteContext, decisions
from autoshard.passes.tensor_parallel import ParamShard, tensor_parallel
from autoshard.runtime.collectives import (
    copy_to_tp,
    reduce_from_tp,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from autoshard.runtime.groups import tp_rank

from graphs import RMS

# ---------------------------------------------------------------------------------------------
# Before: spec.LM with one of these blocks as its layer


class MLP(nn.Module):
    def __init__(self, dim: int = 32, inner: int = 64, out: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, inner, bias=False)
        self.fc2 = nn.Linear(inner, out, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Grouped-query attention: 4 query heads, 2 key/value heads of 8 features."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        b, s = x.size(0), x.size(1)
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MultiQuery(nn.Module):
    """Multi-query attention through a fused projection (Falcon's): 4 query heads and one key and
    value head of 8 features, split off the projection's output viewed into heads."""

    def __init__(self, dim: int = 32, heads: int = 4, head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(dim, (heads + 2) * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(x).view(b, s, self.heads + 2, self.head_dim).split([self.heads, 1, 1], dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class LowRank(nn.Module):
    """A norm, then a low-rank projection normalised over all its features (MLA's q_a_proj and
    q_a_layernorm) before an MLP: the projection and both norms stay whole."""

    def __init__(self, inner: int = 64):
        super().__init__()
        self.norm, self.low, self.mlp = RMS(32), nn.Linear(32, 16, bias=False), MLP(16, inner)

    def forward(self, x):
        return self.mlp(F.rms_norm(self.low(self.norm(x)), (16,)))


def rewrite(model: nn.Module):
    ctx = RewriteContext(tp=2)
    return tensor_parallel(before(model), ctx), ctx


# the decisions every spec's embedding, head and loss carry
VOCAB_META = {
    "model_embed_weight": {"tp": "sharded"},
    "vocab_parallel_embedding": {"tp": "replicated", "op_class": "embedding"},
    "model_head": {"tp_role": "vocab"},
    "vocab_parallel_cross_entropy": {"tp": "replicated", "op_class": "loss"},
}


# ---------------------------------------------------------------------------------------------
# Expected: rank 0's program at tp=2


class MLPRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LM(MLP(inner=32), vocab=32)  # fc1's outputs and fc2's inputs halved, the vocabulary too

    def forward(self, tokens):
        m, mlp = self.model, self.model.layers[0]
        x = vocab_parallel_embedding(tokens, m.embed.weight)
        h = reduce_from_tp(mlp.fc2(F.gelu(mlp.fc1(copy_to_tp(x)))))  # column, row, all-reduce
        logits = m.head(copy_to_tp(x + h))
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), tokens.flatten(), -100, "mean")


def test_an_mlp_is_a_column_row_pair_between_copy_and_reduce():
    gm, ctx = rewrite(LM(MLP()))
    assert_same_program(
        gm,
        program(MLPRank()),
        meta={
            **VOCAB_META,
            "copy_to_tp": {"tp": "replicated"},
            "model_layers_0_fc1": {"tp_role": "column"},
            "model_layers_0_fc2": {"tp_role": "row"},
            "reduce_from_tp": {"tp": "replicated"},
        },
    )
    assert decisions(gm).shards["model.layers.0.fc1.weight"] == ParamShard(0, (64,), 0)  # rows: out_features
    assert decisions(gm).shards["model.layers.0.fc2.weight"] == ParamShard(1, (64,), 0)  # columns: in_features


class AttentionRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LM(Attention(heads=2, kv_heads=1), vocab=32)

    def forward(self, tokens):
        m, a = self.model, self.model.layers[0]
        x = vocab_parallel_embedding(tokens, m.embed.weight)
        f = copy_to_tp(x)  # one f for q, k and v
        b, s = x.size(0), x.size(1)
        q = a.q(f).view(b, s, 2, 8).transpose(1, 2)  # 2 of the 4 query heads
        k = a.k(f).view(b, s, 1, 8).transpose(1, 2)  # 1 of the 2 key/value heads
        v = a.v(f).view(b, s, 1, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = reduce_from_tp(a.o(out.transpose(1, 2).reshape(b, s, 16)))
        logits = m.head(copy_to_tp(x + h))
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), tokens.flatten(), -100, "mean")


def test_attention_is_split_by_heads_and_the_view_constants_are_local():
    gm, ctx = rewrite(LM(Attention()))
    assert_same_program(gm, program(AttentionRank()), meta={**VOCAB_META, "copy_to_tp": {"tp": "replicated"}})
    # q's rows are (heads, head_dim): rank r takes whole heads, and o's columns the same ones
    assert decisions(gm).shards["model.layers.0.q.weight"] == ParamShard(0, (4, 8), 0)
    assert decisions(gm).shards["model.layers.0.k.weight"] == ParamShard(0, (2, 8), 0)
    assert decisions(gm).shards["model.layers.0.o.weight"] == ParamShard(1, (4, 8), 0)


class MultiQueryRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LM(MultiQuery(), vocab=32)
        self.model.layers[0].o = nn.Linear(16, 32, bias=False)  # 2 of the 4 query heads in

    def forward(self, tokens):
        m, a = self.model, self.model.layers[0]
        x = vocab_parallel_embedding(tokens, m.embed.weight)
        f = copy_to_tp(x)
        b, s = x.size(0), x.size(1)
        rank = call(tokens, tp_rank)  # this rank, read at run time
        w = a.qkv.weight  # whole on every rank: rows 0-31 the query heads, 32-39 the key, 40-47 the value
        mine = torch.cat(
            [torch.narrow(w, 0, rank * 16 + 0, 16), torch.narrow(w, 0, 32, 8), torch.narrow(w, 0, 40, 8)], 0
        )
        q, k, v = F.linear(f, mine).view(b, s, 4, 8).split([2, 1, 1], dim=2)  # 2 query heads, the key and value head
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        h = reduce_from_tp(a.o(out.transpose(1, 2).reshape(b, s, 16)))
        logits = m.head(copy_to_tp(x + h))
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), tokens.flatten(), -100, "mean")


def test_a_single_key_value_head_of_a_fused_projection_is_kept_whole_on_every_rank():
    """Megatron's replication of key/value heads fewer than the TP degree: the fused projection's
    weight stays whole, each rank cuts its query rows and the one key and value head out of it,
    and its gradient, partial over the ranks, is summed (``partial_grads``)."""
    gm, ctx = rewrite(LM(MultiQuery()))
    assert_same_program(
        gm,
        program(MultiQueryRank()),
        meta={**VOCAB_META, "linear": {"tp_role": "column", "tp": "sharded"}, "model_layers_0_o": {"tp_role": "row"}},
    )
    assert "model.layers.0.qkv.weight" not in decisions(gm).shards
    assert decisions(gm).partial_grads == ["model.layers.0.qkv.weight"]
    assert decisions(gm).shards["model.layers.0.o.weight"] == ParamShard(1, (4, 8), 0)  # whole query heads


def test_a_single_key_value_head_projection_is_kept_whole_on_every_rank():
    """Multi-query attention with its own key and value projections: rank 0 runs the program of
    grouped-query attention split in two (2 query heads, one key/value head), but the key and
    value weights are whole, not halved, and their gradients are summed over the ranks."""
    gm, ctx = rewrite(LM(Attention(kv_heads=1)))
    assert_same_program(gm, program(AttentionRank()), meta={**VOCAB_META, "copy_to_tp": {"tp": "replicated"}})
    whole = ["model.layers.0.k.weight", "model.layers.0.v.weight"]
    assert not set(whole) & set(decisions(gm).shards)
    assert decisions(gm).partial_grads == whole


class VocabRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LM(vocab=32)

    def forward(self, tokens):
        m = self.model
        x = vocab_parallel_embedding(tokens, m.embed.weight)  # this rank's 32 of the 64 rows
        logits = m.head(copy_to_tp(x))  # this rank's 32 of the 64 logits
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), tokens.flatten(), -100, "mean")


def test_the_embedding_head_and_loss_are_vocabulary_parallel():
    gm, ctx = rewrite(LM())
    assert_same_program(gm, program(VocabRank()), meta=VOCAB_META)
    shards = decisions(gm).shards
    assert shards["model.embed.weight"] == shards["model.head.weight"] == ParamShard(0, (64,), 0)


class LowRankRank(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LM(LowRank(inner=32), vocab=32)

    def forward(self, tokens):
        m, r = self.model, self.model.layers[0]
        x = vocab_parallel_embedding(tokens, m.embed.weight)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * r.norm.w  # whole
        low = F.rms_norm(r.low(normed), (16,))  # whole: 32 -> 16 on every rank
        h = reduce_from_tp(r.mlp.fc2(F.gelu(r.mlp.fc1(copy_to_tp(low)))))
        logits = m.head(copy_to_tp(x + h))
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), tokens.flatten(), -100, "mean")


def test_a_projection_normalised_over_all_its_features_and_the_norms_are_left_whole():
    gm, ctx = rewrite(LM(LowRank()))
    assert_same_program(
        gm,
        program(LowRankRank()),
        meta={**VOCAB_META, "model_layers_0_low": {"tp_role": "replicated", "tp": "replicated"}},
    )
    shards = decisions(gm).shards
    assert "model.layers.0.low.weight" not in shards and "model.layers.0.norm.w" not in shards

"""What a cache hit saves in prefill compute: a block deep in a long context costs more.

Model. Prefilling the token at position p (0-based) of a sequence costs, in multiply-adds,
a fixed part (the projections and the MLP, the same for every token) plus attention over the
p + 1 keys before and at it (q.k scores and the weighted sum of values: 2 x heads x head_dim
per key and layer). In units of one token's fixed part::

    cost(p) = 1 + (p + 1) / L0        L0 = fixed MACs per token / attention MACs per key

so a prompt of n tokens costs ``prefix_cost(n) = n + n (n + 1) / (2 L0)`` and a hit on its first
m tokens saves ``prefix_cost(m)``. The embedding lookup, norms, softmax and the LM head (run
once per prompt, not per cached token) are left out; so are memory-bound effects (at short
contexts real prefill is not compute-bound, which makes every token cost about the same:
L0 -> infinity, the plain hit rate). For the embedded SmolLM2-135M (30 layers, hidden 576,
9 query heads and 3 KV heads of 64, MLP 1536) L0 = 3,072: a token at position 3,072 costs twice
one at the start, one at 8,191 about 3.7 times.

The cost-weighted hit rate of a replay is sum of saved ``prefix_cost(hit tokens)`` over sum of
``prefix_cost(prompt tokens)``: the fraction of prefill compute the cache saved.
"""

from __future__ import annotations


def attention_crossover(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                        intermediate: int, gated_mlp: bool = True) -> float:
    """L0: the position at which a token's attention MACs equal its fixed (projection + MLP) MACs.

    >>> attention_crossover(576, 30, 9, 3, 64, 1536)  # SmolLM2-135M
    3072.0
    """
    q = heads * head_dim
    fixed = hidden * q + 2 * hidden * kv_heads * head_dim + q * hidden
    fixed += (3 if gated_mlp else 2) * hidden * intermediate
    return float(fixed * layers) / (2 * q * layers)


#: L0 of the embedded SmolLM2-135M-Instruct (the model every trace is tokenized for).
SMOLLM2_L0 = attention_crossover(576, 30, 9, 3, 64, 1536)


def prefix_cost(n: int, l0: float = SMOLLM2_L0) -> float:
    """Prefill cost of the first ``n`` tokens of a sequence, in fixed-part units.

    >>> prefix_cost(0), prefix_cost(1, l0=1.0), prefix_cost(3, l0=2.0)
    (0.0, 2.0, 6.0)
    """
    return n + n * (n + 1) / (2.0 * l0)


def block_cost(depth: int, block_size: int, l0: float = SMOLLM2_L0) -> float:
    """Prefill cost of block ``depth`` (tokens depth*B .. depth*B + B - 1) of a sequence.

    >>> block_cost(0, 4, 2.0) + block_cost(1, 4, 2.0) == prefix_cost(8, 2.0)
    True
    """
    return prefix_cost((depth + 1) * block_size, l0) - prefix_cost(depth * block_size, l0)

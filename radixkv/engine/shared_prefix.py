"""Compute a shared, not-yet-cached prefix once: which sequence must wait for which.

The prefix cache only shares blocks that are *committed* (their KV written by a forward). Two
sequences that need the same new prefix in the same step would each compute it (and hold a
private copy of every block until the commit deduplicates them). That costs compute (five RAG
questions about a new document prefill the document five times) and memory: the n samples of a
preempted request, re-admitted together, each need the whole prompt again, so a request that ran
fine can look as if it "can never fit" the pool.

The rule the scheduler applies (vLLM and SGLang hold such followers the same way):

* a *leader* computes the shared part; a *follower* is held until the leader's computed tokens
  cover every full block the follower could share, then it is allocated and matches those
  blocks in the prefix cache;
* across requests: a waiting request is not admitted while a running sequence that shares a
  prefix with it is still prefilling that prefix (it stays in the queue; later requests that
  share nothing are admitted meanwhile);
* within a request (n samples or beams after a preemption): the first sequence is allocated
  alone; the others join once it has computed their shared blocks. Until then the leader
  computes up to all but its last token, so the group still gets its logits in one step.

Only whole blocks are shared, and a follower never waits for the block holding its own last
token (that one is always private), so the wait always ends: the leader either computes the
shared blocks or leaves the running set (finished, preempted), which releases the hold.

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, compared a block at a time
    (list slices compare in C). O(common prefix).

    >>> common_prefix_len([1, 2, 3, 4, 5], [1, 2, 3, 9], 2)
    3
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + block_size] == b[i:i + block_size]:
        i += block_size
    while i < n and a[i] == b[i]:   # inside the first differing block (or a shorter tail)
        i += 1
    return min(i, n)


def share_target(follower: Sequence[int], leader: Sequence[int], block_size: int) -> int:
    """Tokens of ``follower`` (a whole number of blocks) that ``leader``'s committed blocks can
    serve: the common full blocks, excluding either sequence's last token (a sequence's last
    token lives in a private block it computes itself)."""
    c = common_prefix_len(follower, leader, block_size)
    return min(c, len(follower) - 1, len(leader) - 1) // block_size * block_size


def blocks_to_wait_for(follower: Sequence[int], leader: Sequence[int], leader_computed: int,
                       block_size: int) -> int:
    """Full blocks ``follower`` could share with ``leader`` that the leader has not computed
    yet (0: nothing to wait for).

    >>> blocks_to_wait_for([1] * 40, [1] * 40, 16, 16)   # 2 shareable blocks, 1 computed
    1
    """
    if leader_computed >= len(leader) - 1:
        return 0   # the leader computed all it will ever share
    target = share_target(follower, leader, block_size)
    return max(0, (target - leader_computed // block_size * block_size) // block_size)


class Leaders:
    """Candidate leaders of one admission pass, indexed by (namespace, first block of tokens).

    A follower can wait for a leader only if they share at least their first full block
    (:func:`share_target` counts whole common blocks), in the same namespace, so a waiting
    request is compared only with the leaders filed under its own first block: admitting B
    requests with distinct prompts is O(B), not O(B^2) prefix comparisons.

    >>> from types import SimpleNamespace as S
    >>> leaders = Leaders(2)
    >>> leaders.add("ns", S(token_ids=[1, 2, 3]), "r0")
    >>> [r for r, _ in leaders.candidates("ns", [1, 2, 9, 9])], leaders.candidates("ns", [1, 3, 5])
    (['r0'], [])
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_key: dict[tuple, list] = {}

    def _key(self, namespace: object, tokens: Sequence[int]) -> tuple | None:
        bs = self.block_size
        if len(tokens) - 1 < bs:
            return None   # no full block besides the last token's: shares nothing
        return (namespace, tuple(tokens[:bs]))

    def add(self, namespace: object, seq: object, owner: object) -> None:
        """File ``seq`` (anything with ``token_ids``) of ``owner`` as a candidate."""
        key = self._key(namespace, seq.token_ids)   # type: ignore[attr-defined]
        if key is not None:
            self._by_key.setdefault(key, []).append((owner, seq))

    def candidates(self, namespace: object, tokens: Sequence[int]) -> list:
        """The ``(owner, seq)`` pairs a follower with ``tokens`` could share blocks with."""
        key = self._key(namespace, tokens)
        return [] if key is None else self._by_key.get(key, [])


__all__ = ["common_prefix_len", "share_target", "blocks_to_wait_for", "Leaders"]

"""ChatSession: the history stays as generated token ids, so later turns hit the reply's blocks."""

from __future__ import annotations

from radixkv import SamplingParams
from radixkv.benchmarks.traces import lcp

from .conftest import BLOCK_SIZE

P20 = SamplingParams(max_tokens=20)


def full_blocks(n_tokens: int) -> int:
    return n_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_turn_two_hits_turn_one_prompt_and_reply_blocks(make_engine):
    e = make_engine()
    s = e.chat(system="You are a terse assistant.")
    r1 = s.send("Hi there, who are you?", P20)
    p1 = r1.prompt_tokens
    assert r1.cached_tokens == 0 and r1.turn == 1 and len(r1.token_ids) == 20
    # The history holds the reply's ids exactly as generated, then the end of turn
    # (<|im_end|>\n: the random model never emitted <|im_end|> itself).
    hist = s.history_ids
    assert hist[p1:p1 + 20] == r1.token_ids
    assert hist[p1 + 20:] == s.template.end_of_turn_ids
    r2 = s.send("Tell me more about that.", P20)
    # Cached after turn 1: every token of prompt + reply except the last sampled one, whose
    # KV is never computed: the full blocks from the tree, the rest from turn 1's partial
    # last block (kept as a tail, core/tails.py).
    expect = p1 + len(r1.token_ids) - 1
    assert r2.cached_tokens == expect
    assert r2.cached_tokens >= full_blocks(p1) and r2.cached_tokens > p1
    r3 = s.send("And then?", P20)
    assert r3.cached_tokens == r2.prompt_tokens + 20 - 1
    assert 0 < r3.hit_rate < 1 and r3.ttft > 0


def test_naive_rerendering_loses_hits_that_the_session_keeps(make_engine):
    """Measure what a client that re-renders the history *text* would hit instead."""
    e = make_engine()
    s = e.chat(system="You are a terse assistant.")
    lost = []
    computed = 0    # tokens of the last turn whose KV was computed (its partial block a tail)
    for msg in ("First question?", "Second question?", "Third question?"):
        ours, naive = s.next_prompt_ids(msg), s.naive_prompt_ids(msg)
        hit_ours, hit_naive = e.cached_prefix_tokens(ours), e.cached_prefix_tokens(naive)
        lost.append((len(ours), lcp(ours, naive), hit_ours, hit_naive))
        reply = s.send(msg, P20)
        assert reply.cached_tokens == max(min(hit_ours, full_blocks(len(ours) - 1)), computed)
        computed = reply.prompt_tokens + len(reply.token_ids) - 1
    # Turn 1: identical prompts, nothing cached. Later turns: the random model's replies do not
    # survive decode -> re-encode, so the naive prompt diverges inside the first reply and
    # hits only the blocks before it; the session hits every full block before the new message.
    assert lost[0][0] == lost[0][1] and lost[0][2] == lost[0][3] == 0
    for n, common, ours, naive in lost[1:]:
        assert common < n and naive <= full_blocks(common) < ours
    print("\n(prompt tokens, common prefix with naive, cached ours, cached naive):", lost)


def test_stream_yields_text_pieces_and_closes_the_turn(make_engine):
    e = make_engine()
    s = e.chat()
    pieces = list(s.stream("Say something.", P20))
    reply = s.last_reply
    assert reply is not None and "".join(pieces) == reply.text
    assert s.messages[-1] == {"role": "assistant", "content": reply.text}
    r2 = s.send("Again.", P20)
    assert r2.cached_tokens == reply.prompt_tokens + 20 - 1   # whole blocks and the tail


def test_abandoned_stream_leaves_history_unchanged(make_engine):
    e = make_engine()
    s = e.chat()
    s.send("One.", P20)
    before = (list(s.messages), s.history_ids)
    it = s.stream("Two.", P20)
    next(it, None)
    it.close()
    assert (s.messages, s.history_ids) == before and len(s.replies) == 1


def test_sessions_with_different_salts_never_share(make_engine):
    e = make_engine()
    sys_msg = "You are a helpful assistant. " * 6       # a few blocks of shared system prompt
    a = e.chat(system=sys_msg, cache_salt="alice")
    b = e.chat(system=sys_msg, cache_salt="bob")
    a2 = e.chat(system=sys_msg, cache_salt="alice")
    assert a.send("Hello", P20).cached_tokens == 0
    assert b.send("Hello", P20).cached_tokens == 0   # same prompt, other tenant: cold
    hit = a2.send("Hello", P20).cached_tokens        # same tenant: shares the system prompt
    assert hit >= full_blocks(len(e.tokenizer(sys_msg)["input_ids"]))


def test_reset_keeps_system_message(make_engine):
    e = make_engine()
    s = e.chat(system="Sys.")
    s.send("Hi", P20)
    s.reset()
    assert s.messages == [{"role": "system", "content": "Sys."}] and s.history_ids == []
    assert s.send("Hi", P20).cached_tokens > 0          # the first prompt's blocks are cached


def test_session_hints_reach_the_policy_and_close_ends_the_session(make_engine):
    """A chat session's turns carry its id to the eviction policy; ``close()`` (or the last
    turn's ``end_session=True``) says it is over; bad hints are typed errors."""
    import pytest

    from radixkv.errors import InvalidRequestError

    e = make_engine(policy="forecast")
    pol = e.core.block_manager.tree.policy
    s = e.chat(system="You are terse.", session_id="conv-1")
    s.send("Hi there.", P20)
    s.send("More.", P20)
    assert pol._last.get("conv-1") is not None and pol.followups == 1
    s.close()
    assert "conv-1" in pol._ended and s.closed
    with pytest.raises(InvalidRequestError, match="closed"):
        s.send("Again?", P20)
    s.close()                                    # idempotent
    assert e.stats()["session_ends"] == 1        # close() -> engine.end_session
    t = e.chat(session_id="conv-2")
    t.send("Only turn.", P20, end_session=True)
    assert "conv-2" in pol._ended and t.closed
    assert e.stats()["session_ends"] == 2        # the turn's flag
    assert e.chat().session_id.startswith("chat-")
    for bad in [dict(session_id=""), dict(session_id=7)]:
        with pytest.raises(InvalidRequestError):
            e.chat(**bad)
    with pytest.raises(InvalidRequestError):
        e.submit("x", P20, session=[1])
    with pytest.raises(InvalidRequestError):
        e.submit("x", P20, end_session="yes")
    with pytest.raises(InvalidRequestError):
        e.end_session(None)
    lru = make_engine()
    lru.chat(session_id="c").send("Hi.", P20, end_session=True)   # ignored by LRU


def test_the_default_policy_turns_to_the_forecast_when_a_session_closes(make_engine):
    """The default (``auto``) is LRU until a client says a session is over, end to end: the
    engine's tree hands eviction to the forecast at the first ``close()``."""
    from radixkv.core.policy import LRUPolicy
    from radixkv.core.policy_registry import DEFAULT_POLICY
    from radixkv.core.policy_forecast import ForecastPolicy

    e = make_engine(policy=DEFAULT_POLICY)
    tree = e.core.block_manager.tree
    s = e.chat(session_id="conv-1")
    s.send("Hi there.", P20)
    assert type(tree.policy) is LRUPolicy and tree.policy.name == "auto"
    s.close()
    assert type(tree.policy) is ForecastPolicy
    t = e.chat(session_id="conv-2")
    t.send("Only turn.", P20, end_session=True)
    assert "conv-2" in tree.policy._ended
    e.core.block_manager.check_invariants()

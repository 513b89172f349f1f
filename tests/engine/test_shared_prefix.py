"""Requests and sequences that share a prefix nobody has computed yet (issue 18, items 1 and 8).

* n samples / beams resumed after a preemption used to be re-allocated one by one, each needing
  the whole prompt again, so a request that ran fine alone was declared "can never fit" and came
  back truncated with ``finish_reason="length"``. Now its first sequence is allocated alone and
  the others join once it has computed the shared blocks; a request that really cannot fit ends
  with ``"capacity"`` and is counted.
* a batch whose prompts share a new prefix computes it once: followers are held until the
  leader's blocks are committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import copy

import pytest
import torch

from radixkv.config import CacheConfig, EngineConfig
from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, Sequence
from radixkv.engine.shared_prefix import blocks_to_wait_for, common_prefix_len, share_target

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import run_requests  # noqa: E402


@pytest.fixture(scope="module")
def hf(make_tiny):
    return make_tiny("llama", num_layers=2)


def _engine(model, num_blocks, block_size=16):
    return LLMEngine(copy.deepcopy(model), None,
                     CacheConfig(block_size=block_size, num_device_blocks=num_blocks),
                     EngineConfig(max_num_seqs=32, max_num_batched_tokens=2048), model_id="tiny")


def _prompts(n, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


_run = run_requests


def _tokens(out):
    return [(c.token_ids, c.finish_reason) for c in out.outputs]


# ----------------------------------------------------------------------------- item 1

@pytest.mark.parametrize("params,num_blocks", [
    (SamplingParams(max_tokens=32, temperature=0.9, top_k=50, seed=7, n=4, ignore_eos=True), 20),
    (SamplingParams(max_tokens=32, beam_width=4, ignore_eos=True), 24),
], ids=["seeded-n4", "beam4"])
def test_group_resumed_after_preemption_is_not_truncated(hf, params, num_blocks):
    """The issue's set-up: four 125-token prompts, a 20-block (n=4) / 24-block (beam 4) pool."""
    prompts = _prompts(4, 125)
    eng = _engine(hf, num_blocks)
    out = _run(eng, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert eng.stats()["preemptions"] > 0
    resumed = [rid for rid, o in out.items() if o.num_preemptions]
    assert resumed
    for rid in resumed[:1]:   # a resumed request gets exactly what it gets alone on a fresh pool
        alone = _run(_engine(hf, num_blocks), [(rid, prompts[int(rid[1:])], params)])[rid]
        assert _tokens(out[rid]) == _tokens(alone), rid
    for o in out.values():
        assert all(len(c.token_ids) == 32 and c.finish_reason == "length" for c in o.outputs)
    assert eng.stats()["unschedulable"] == 0


def test_group_that_cannot_fit_even_alone_finishes_with_capacity(hf):
    # 4 samples of a 125-token prompt growing to 157 tokens need 7 + 4 * 3 = 19 blocks.
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=3, n=4, ignore_eos=True)
    eng = _engine(hf, 14)
    [p] = _prompts(1, 125)
    o = _run(eng, [("a", p, params)])["a"]
    assert {c.finish_reason for c in o.outputs} == {"capacity"}
    assert all(0 < len(c.token_ids) < 32 for c in o.outputs)
    assert eng.stats()["unschedulable"] == 1
    assert eng.block_manager.num_free_blocks + eng.tree.num_evictable() == 14


# ----------------------------------------------------------------------------- item 8

def test_batch_with_a_shared_new_prefix_prefills_it_once(hf):
    doc = _prompts(1, 200, seed=5)[0]
    questions = _prompts(5, 20, seed=6)
    batch = [doc + q for q in questions]
    params = SamplingParams(max_tokens=4)
    eng = _engine(hf, 128)
    together = _run(eng, [(f"q{i}", p, params) for i, p in enumerate(batch)])
    st = eng.stats()
    # The 12 full blocks of the document (192 tokens) are computed once, not five times.
    assert st["prefill_tokens_computed"] == len(batch[0]) + 4 * (len(batch[0]) - 192)
    assert st["held_admissions"] > 0
    assert [together[f"q{i}"].num_cached_tokens for i in range(5)] == [0, 192, 192, 192, 192]
    sep = _engine(hf, 128)   # the same answers as one at a time
    for i, p in enumerate(batch):
        assert together[f"q{i}"].outputs[0].token_ids == \
            _run(sep, [(f"s{i}", p, params)])[f"s{i}"].outputs[0].token_ids


def test_unrelated_requests_are_not_held_behind_a_held_one():
    bm = BlockManager.create(64, 4)
    s = Scheduler(bm, 8, 64)
    ns = Namespace("toy")
    ids = iter(range(100))

    def req(rid, toks):
        r = Request(rid, toks, SamplingParams(max_tokens=2), ns)
        r.seqs.append(Sequence(next(ids), 0, list(toks), len(toks), IncrementalDetokenizer(None)))
        return r

    shared = list(range(1, 21))
    a, b, c = req("a", shared + [30, 31]), req("b", shared + [40]), req("c", [90, 91, 92, 93, 94])
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [ch.request.request_id for ch in out.chunks] == ["a", "c"]   # b waits for a's blocks
    assert list(s.waiting) == [b] and s.counters.held_admissions == 1
    for ch in out.chunks:
        bm.commit(ch.seq.seq_id, ch.start + ch.num_tokens)
        ch.seq.token_ids.append(7)
    out = s.schedule()
    [chb] = [ch for ch in out.chunks if ch.request is b]
    assert (chb.start, chb.num_tokens) == (20, 1)    # 5 shared blocks matched
    bm.check_invariants()


def test_shared_prefix_helpers():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4], 4) == 3
    assert common_prefix_len([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 2) == 5
    assert common_prefix_len([5], [1], 4) == 0
    assert share_target([1] * 33, [1] * 33, 16) == 32
    assert share_target([1] * 32, [1] * 40, 16) == 16    # the follower's last token is private
    assert blocks_to_wait_for([1] * 40, [1] * 40, 39, 16) == 0   # leader computed all it shares

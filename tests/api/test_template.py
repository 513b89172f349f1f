"""Chat-template analysis with the real SmolLM2 tokenizer (no model needed)."""

from __future__ import annotations

import pytest

from radixkv.api.chat import ChatTemplate
from radixkv.errors import ConfigError


def test_end_of_turn_is_derived_from_the_template(smol_tokenizer):
    t = ChatTemplate(smol_tokenizer)
    assert t.append_only
    assert t.end_of_turn_text == "<|im_end|>\n"
    assert (t.end_of_turn_ids
            == smol_tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"])


def test_close_reply_appends_only_what_the_model_did_not_emit(smol_tokenizer):
    t = ChatTemplate(smol_tokenizer)
    im_end, nl = t.end_of_turn_ids
    assert t.close_reply([5, 6, im_end]) == [nl]       # stopped on <|im_end|>
    assert t.close_reply([5, 6]) == [im_end, nl]       # cut by max_tokens
    assert t.close_reply([5, im_end, nl]) == []        # already complete
    assert t.close_reply([]) == [im_end, nl]


def test_incremental_prompt_equals_full_render_when_text_roundtrips(smol_tokenizer):
    """For replies whose text re-tokenizes to the same ids, the incremental prompt and the
    naive full re-render agree token for token (so the incremental one loses nothing)."""
    t = ChatTemplate(smol_tokenizer)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    p1 = t.prompt_ids(msgs)
    reply = t.encode("Hello! How can I help?") + [t.end_of_turn_ids[0]]
    hist = msgs + [{"role": "assistant", "content": "Hello! How can I help?"}]
    new = [{"role": "user", "content": "Tell me a joke."}]
    incremental = p1 + reply + t.close_reply(reply) + t.turn_delta(hist, new)
    assert incremental == t.prompt_ids(hist + new)


def test_default_system_prompt_injection_is_handled(smol_tokenizer):
    t = ChatTemplate(smol_tokenizer)
    msgs = [{"role": "user", "content": "Hi"}]
    p1 = t.prompt_ids(msgs)
    assert "SmolLM" in smol_tokenizer.decode(p1)       # the template's default system message
    reply = t.encode("Hey.") + [t.end_of_turn_ids[0]]
    hist = msgs + [{"role": "assistant", "content": "Hey."}]
    new = [{"role": "user", "content": "Again"}]
    assert p1 + reply + t.close_reply(reply) + t.turn_delta(hist, new) == t.prompt_ids(hist + new)


def test_template_that_rewrites_history_is_detected(smol_tokenizer):
    """A template that drops earlier assistant turns is not append-only: turn_delta says None."""
    import copy

    tok = copy.copy(smol_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = ChatTemplate(tok)
    hist = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert t.turn_delta(hist, [{"role": "user", "content": "c"}]) is None


def test_tokenizer_without_template_is_a_config_error(smol_tokenizer):
    import copy

    tok = copy.copy(smol_tokenizer)
    tok.chat_template = None
    with pytest.raises(ConfigError):
        ChatTemplate(tok)

"""The server's RAG layouts without a server: chat documents placed RAGHelper's way and text
documents found in a prompt, each with exact token spans (radixkv.api.rag)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import InvalidRequestError
from radixkv.api.chat import ChatTemplate
from radixkv.api.rag import chat_document_prompt, document_text, text_document_prompt

BS = 16
WORDS = st.lists(st.sampled_from(["river", "Lyon", " ice", "12", "\n", "é", "the", ".", "  "]),
                 min_size=1, max_size=12).map("".join).filter(lambda t: t.strip() != "")


@pytest.fixture(scope="module")
def template(smol_tokenizer):
    return ChatTemplate(smol_tokenizer)


@settings(max_examples=30, deadline=None)
@given(docs=st.lists(WORDS, min_size=1, max_size=4), gaps=st.lists(WORDS, min_size=5,
                                                                    max_size=5))
def test_text_documents_are_found_and_their_spans_are_exact(template, smol_tokenizer, docs,
                                                            gaps):
    text = gaps[0] + "".join(d + g for d, g in zip(docs, gaps[1:]))
    out = text_document_prompt(
        lambda t: [int(i) for i in smol_tokenizer(t)["input_ids"]], template.encode, text, docs)
    decode = smol_tokenizer.decode
    assert decode(out.token_ids) == decode(smol_tokenizer(text)["input_ids"])   # unchanged
    assert len(out.spans) == len(docs)
    for (s, e), d in zip(out.spans, docs):
        assert decode(out.token_ids[s:e]) == d
    assert all(a[1] <= b[0] for a, b in zip(out.spans, out.spans[1:]))


def test_a_document_not_in_the_text_or_out_of_order_is_refused(template):
    enc = template.encode
    with pytest.raises(InvalidRequestError, match="document 1 was not found"):
        text_document_prompt(enc, enc, "alpha beta gamma", ["alpha", "delta"])
    with pytest.raises(InvalidRequestError, match="occurs earlier"):
        text_document_prompt(enc, enc, "alpha beta gamma", ["gamma", "alpha"])
    with pytest.raises(InvalidRequestError, match="occurs earlier"):   # no overlap
        text_document_prompt(enc, enc, "alphabet", ["alpha", "alphabet"])


@settings(max_examples=20, deadline=None)
@given(docs=st.lists(st.one_of(WORDS, st.builds(lambda t, x: {"title": t, "text": x},
                                                   WORDS, WORDS)), min_size=1, max_size=4),
       history=st.booleans())
def test_chat_documents_are_placed_before_the_last_question_in_whole_blocks(template, docs,
                                                                            history):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1?"}]
    if history:
        msgs += [{"role": "assistant", "content": "A1."}, {"role": "user", "content": "Q2?"}]
    out = chat_document_prompt(template, msgs, docs, BS)
    spans = out.spans
    assert all(s % BS == 0 and e % BS == 0 and s < e for s, e in spans)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))      # back to back
    for (s, e), d in zip(spans, docs):
        assert template.tokenizer.decode(out.token_ids[s:e]).rstrip("\n") == \
            document_text(d).rstrip("\n")
    # the rest is the conversation as rendered, the last question after the documents
    before = template.tokenizer.decode(out.token_ids[:spans[0][0]]).rstrip("\n")
    after = template.tokenizer.decode(out.token_ids[spans[-1][1]:])
    rendered = template.render(msgs, add_generation_prompt=True)
    question = msgs[-1]["content"]
    assert rendered.endswith(after) and after.startswith(question)
    assert rendered[:len(rendered) - len(after)].rstrip("\n") == before   # + padding only
    # a document's tokens do not depend on its place in the list: the same entry in any order
    rev = chat_document_prompt(template, msgs, docs[::-1], BS)
    seg = {tuple(out.token_ids[s:e]) for s, e in spans}
    assert {tuple(rev.token_ids[s:e]) for s, e in rev.spans} == seg


def test_chat_documents_need_a_user_message(template):
    with pytest.raises(InvalidRequestError, match="no user message"):
        chat_document_prompt(template, [{"role": "system", "content": "s"}], ["doc"], BS)

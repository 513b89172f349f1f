"""A small RAG app on radixkv: documents are computed once and shared by every question.

Run:  python docs/examples/rag_app.py      (embedded SmolLM2-135M-Instruct, CPU is fine)

Uses only the public API (``import radixkv``). Retrieval is out of scope: pass the ids your
retriever chose to ``ask``; the helper orders them canonically so equal sets share a prefix.
"""

from __future__ import annotations

import radixkv

DOCS = {
    "returns": "Items can be returned within 30 days of delivery for a full refund. Items must be "
               "unused and in their original packaging. Refunds are issued to the original "
               "payment method within 5 business days of receiving the return.",
    "shipping": "Standard shipping takes 3 to 5 business days and is free for orders over 50 "
                "euros. Express shipping takes 1 business day and costs 9 euros. We ship to all "
                "countries of the European Union.",
    "warranty": "All electronics come with a two-year warranty covering manufacturing defects. "
                "The warranty does not cover accidental damage, water damage or normal wear. To "
                "make a claim, contact support with your order number.",
}
QUESTIONS = [
    "How long do I have to return an item?",
    "Is shipping free?",
    "Does the warranty cover a dropped phone?",
    "How fast is express shipping?",
]


def main() -> None:
    # The "priority" policy lets pinned documents outlive other blocks under memory pressure.
    engine = radixkv.Engine.from_pretrained(cache_config=radixkv.CacheConfig(policy="priority"))
    rag = engine.rag(cache_salt="shop-42")
    for doc_id, text in DOCS.items():
        rag.add_document(doc_id, text)                # tokenized once
    rag.pin(list(DOCS), priority=10)                  # compute the documents once, keep them

    params = radixkv.SamplingParams(max_tokens=40)
    for q in QUESTIONS:
        a = rag.ask(q, list(DOCS), params)            # same documents -> same cached prefix
        print(f"\nQ: {q}\nA: {a.text.strip()}\n   [{a.cached_tokens} of {a.prompt_tokens} prompt "
              f"tokens from cache ({a.hit_rate:.0%}), first token after {a.ttft * 1000:.0f} ms]")

    # Several questions in one continuous batch:
    for a in rag.ask_many(["Where do you ship?", "Who pays for returns?"], params=params):
        print(f"\nA: {a.text.strip()}  [{a.cached_tokens}/{a.prompt_tokens} cached]")
    print(f"\nhit rate overall: {engine.stats()['hit_rate']:.0%}")


if __name__ == "__main__":
    main()

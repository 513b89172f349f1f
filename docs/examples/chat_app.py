"""A multi-turn chat app on radixkv: every turn re-uses the cached history.

Run:  python docs/examples/chat_app.py            (embedded SmolLM2-135M-Instruct, CPU is fine)
      python docs/examples/chat_app.py --turns 2  (shorter)

Uses only the public API (``import radixkv``).
"""

from __future__ import annotations

import argparse

import radixkv

QUESTIONS = [
    "Hi! I'm planning a trip to Lisbon. What should I see first?",
    "How many days would you recommend?",
    "What food should I try there?",
    "Thanks! Any tip for getting around?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=len(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    engine = radixkv.Engine.from_pretrained()
    session = engine.chat(system="You are a concise travel assistant. Answer in two sentences.",
                          cache_salt="user-1234")          # this user's blocks are private
    params = radixkv.SamplingParams(max_tokens=args.max_tokens)

    for question in QUESTIONS[:args.turns]:
        print(f"\nuser> {question}\nbot> ", end="", flush=True)
        for piece in session.stream(question, params):    # stream the reply as it is generated
            print(piece, end="", flush=True)
        r = session.last_reply
        print(f"\n     [turn {r.turn}: {r.prompt_tokens} prompt tokens, {r.cached_tokens} from "
              f"cache ({r.hit_rate:.0%}), first token after {r.ttft * 1000:.0f} ms]")

    stats = engine.stats()
    print(f"\nwhole session: {stats['cached_prompt_tokens']} of {stats['prompt_tokens']} prompt "
          f"tokens served from the cache ({stats['hit_rate']:.0%})")


if __name__ == "__main__":
    main()

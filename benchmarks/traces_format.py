"""The trace file format: :class:`Request`, :class:`Trace`, JSON-lines reading and writing.

Kept apart from the builders so that a replay or a simulator can read a trace file without
importing the tokenizer or the dataset. Format (one file per (kind, parameters, seed)): a header
line ``{"format": "radixkv-trace", "version": ..., "kind": ..., "params": ..., "stats": ...}``
then one line per request ``{"t": seconds, "conv": id, "turn": k, "prompt": [ids],
"reply": [ids], ...}`` in time order (extra keys per kind go to ``Request.meta``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_FORMAT = "radixkv-trace"


@dataclass(slots=True)
class Request:
    """One request of a trace: arrival time (s), conversation/group id, turn, token ids.

    ``prompt`` is what the client sends (token ids after the chat template); ``reply`` is what the
    engine generates (ending with the end-of-turn token). ``meta`` holds kind-specific keys.
    """

    t: float
    conv: int
    turn: int
    prompt: list[int]
    reply: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        d = {"t": round(self.t, 6), "conv": self.conv, "turn": self.turn,
             "prompt": self.prompt, "reply": self.reply}
        d.update(self.meta)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Request:
        d = json.loads(line)
        t, conv, turn = d.pop("t"), d.pop("conv"), d.pop("turn")
        return cls(t, conv, turn, d.pop("prompt"), d.pop("reply"), d)


class Trace(list):
    """A list of :class:`Request` in time order, with the file's header as ``.header``."""

    def __init__(self, requests: Sequence[Request] = (), header: dict[str, Any] | None = None):
        super().__init__(requests)
        self.header: dict[str, Any] = header or {}

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self)


def trace_stats(requests: Sequence[Request]) -> dict[str, Any]:
    """Sizes: requests, conversations, prompt/reply tokens, mean/max prompt length."""
    prompts = [len(r.prompt) for r in requests]
    return {"requests": len(requests), "conversations": len({r.conv for r in requests}),
            "prompt_tokens": sum(prompts), "reply_tokens": sum(len(r.reply) for r in requests),
            "mean_prompt": round(sum(prompts) / max(len(prompts), 1), 1),
            "max_prompt": max(prompts, default=0),
            "max_request": max((len(r.prompt) + len(r.reply) for r in requests), default=0),
            "duration_s": round(requests[-1].t - requests[0].t, 1) if requests else 0.0}


def write_trace(path: Path, header: dict[str, Any], requests: Sequence[Request]) -> None:
    """Write a trace file atomically (temp name, then rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for r in requests:
            f.write(r.to_json() + "\n")
    os.replace(tmp, path)


def read_trace(path: Path | str) -> Trace:
    """Read a trace file written by :func:`write_trace` (or by hand, same format)."""
    with open(path, encoding="utf-8") as f:
        header = json.loads(f.readline())
        if header.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path}: not a {TRACE_FORMAT} file (header {header!r:.200})")
        return Trace([Request.from_json(line) for line in f if line.strip()], header)

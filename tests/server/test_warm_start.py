"""Ready means warmed: what the first request would otherwise pay is done before ``/health``
says 200 (the server's part here; the engine's forward warm-up in
tests/engine/test_engine_correctness.py)."""

from __future__ import annotations

from typing import Any

import pytest

from radixkv.server import app as app_mod
from radixkv.server import serving
from radixkv.server.backend import Backend
from radixkv.server.errors import APIError
from radixkv.server.tenants import Tenants


def _state() -> app_mod.ServerState:
    return app_mod.ServerState("m", Tenants.create([], None), 4, None)


class _Template:
    """A chat template over a tiny vocabulary that records what the server asked of it while
    the backend was not yet published."""

    def __init__(self, state: app_mod.ServerState) -> None:
        self.state = state
        self.rendered_before_ready = 0
        self.tokenizer = self

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "hello": 1, "<|im_start|>": 2}

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.state.engine is None:
            self.rendered_before_ready += 1
        return [2, 1]


class _Backend(Backend):
    model_id, vocab_size, max_model_len, output_tier_names = "m", 3, 64, ("device",)
    max_num_seqs, block_size = 1, 16

    def __init__(self, template: Any) -> None:
        self._template = template

    @property
    def chat_template(self) -> Any:
        if self._template is None:
            raise AttributeError("no chat template")
        return self._template

    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str:
        return ""

    async def open(self, request_id: str, prompt_ids: list[int], params: Any,
                   *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def snapshots(self) -> Any:
        return []


def test_the_vocabulary_scan_and_a_template_render_happen_before_ready() -> None:
    state = _state()
    template = _Template(state)
    app_mod._load(state, lambda: _Backend(template))
    assert state.engine is not None and state.load_error is None
    assert state.max_token_chars == len("<|im_start|>") == serving.max_token_chars(state.engine)
    assert template.rendered_before_ready == 1


def test_a_backend_without_a_template_still_loads() -> None:
    state = _state()
    app_mod._load(state, lambda: _Backend(None))
    assert state.engine is not None and state.load_error is None
    assert state.max_token_chars is None            # left to the first request


def test_a_failed_load_is_reported_not_warmed() -> None:
    state = _state()

    def boom() -> Any:
        raise FileNotFoundError("no such model")

    errors: list[str] = []
    app_mod._load(state, boom, errors.append)
    assert state.engine is None and errors == ["FileNotFoundError: no such model"]
    with pytest.raises(APIError) as err:
        state.ready_engine()
    assert err.value.status == 503


class _CountingTemplate(_Template):
    def __init__(self, state: app_mod.ServerState) -> None:
        super().__init__(state)
        self.scans = 0

    def get_vocab(self) -> dict[str, int]:
        self.scans += 1
        return super().get_vocab()


def test_a_burst_of_requests_scans_the_vocabulary_once() -> None:
    """A server given its engine (``create_app(engine)``, what ``radixkv run-batch`` does)
    had skipped the warm-up, and every request of a burst walked the 49k-token vocabulary on
    its own (256 lines: ~3.6 s of CPU beside the engine). Now the app's start warms it, and
    requests arriving before it is known share one computation."""
    import asyncio

    state = _state()
    template = _CountingTemplate(state)
    backend = _Backend(template)

    async def burst() -> list[int]:
        return await asyncio.gather(*(app_mod._max_token_chars(state, backend)
                                      for _ in range(50)))

    assert asyncio.run(burst()) == [len("<|im_start|>")] * 50 and template.scans == 1
    app = app_mod.create_app(_Backend(counted := _CountingTemplate(state)), model_name="m")

    async def start() -> Any:
        async with app.fastapi.router.lifespan_context(app.fastapi):
            return app.state.max_token_chars

    assert asyncio.run(start()) == len("<|im_start|>") and counted.scans == 1


def test_an_embedded_app_leaves_the_garbage_collector_alone() -> None:
    """Only a server that owns its process (``freeze_heap``: ``radixkv serve``, the fleet)
    freezes the start-up heap and hooks ``gc.callbacks``: frozen objects are never collected,
    which an application that embeds the app has not asked for."""
    import asyncio
    import gc

    frozen, hooks = gc.get_freeze_count(), list(gc.callbacks)
    app = app_mod.create_app(_Backend(_Template(_state())), model_name="m")

    async def start() -> None:
        async with app.fastapi.router.lifespan_context(app.fastapi):
            assert list(gc.callbacks) == hooks

    asyncio.run(start())
    assert gc.get_freeze_count() == frozen and list(gc.callbacks) == hooks
    assert app.state.metrics.frozen_objects == 0

"""``radixkv bench serve --vs-vllm URL`` drives another OpenAI-compatible server with the same
multi-turn replay as the ``radixkv serve`` it starts (issue 33). vLLM is not installable here, so
the "other" server is a second ``radixkv serve`` on 127.0.0.1 (a real subprocess) under another
model name: the code path a vLLM user runs, end to end."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.server.test_openai_server import _value, running_server  # noqa: E402

pytestmark = pytest.mark.model


def test_vs_vllm_replays_the_same_chats_against_another_server(tmp_path, monkeypatch) -> None:
    from radixkv.benchmarks import bench_serve

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    with running_server(["--served-model-name", "other-model", "--threads", "1",
                         "--device", "cpu"]) as other:
        rc = bench_serve.main(["--vs-vllm", other.base + "/v1", "--quick", "--threads", "1"])
        assert rc == 0
        # the other server served every request of the replay, under the name it lists
        served = _value(other.metrics(), "radixkv_request_success", model_name="other-model")
    result = json.loads((tmp_path / "serve-vs-quick.json").read_text())
    assert result["header"]["other_model"] == "other-model"
    rows = {r["server"]: r for r in result["results"]["summary"]}
    assert set(rows) == {"radixkv", "other"}
    # --quick: 2 conversations x 2 turns, one client, against each server
    assert rows["radixkv"]["requests"] == rows["other"]["requests"] == 4
    assert served == 4
    for row in rows.values():
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["requests_per_s"] > 0
        # the second turn re-sends the first (system prompt, question, reply): a radixkv server
        # serves part of it from its cache, whichever of the two it is
        assert row["cached_share"] > 0
    ratios = result["results"]["ratios"]["1"]
    assert ratios["ttft_p50_ratio"] > 0 and ratios["throughput_ratio"] > 0


@pytest.mark.slow   # ~50 s: a model load in this process besides the server's
@pytest.mark.skipif(os.environ.get("RADIXKV_PROFILE") != "soak",
                    reason="slow: set RADIXKV_PROFILE=soak to run")
def test_overhead_pairs_the_server_with_the_engine_in_process(tmp_path, monkeypatch) -> None:
    """``--overhead --quick``: each later turn goes to the server and to the in-process engine
    with the same history; both caches see the same turns, so the server reports cached
    tokens on the second turn and the pair's difference is a finite number."""
    import math

    import torch

    from radixkv.benchmarks import bench_serve

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    before = torch.get_num_threads()
    try:
        assert bench_serve.main(["--overhead", "--quick"]) == 0
    finally:
        torch.set_num_threads(before)
    result = json.loads((tmp_path / "serve-overhead-quick.json").read_text())["results"]
    (row,) = result["summary"]   # --quick: 1 thread, no background load, this code only
    assert row["server"] == "serve" and row["threads"] == 1 and row["busy"] == 0
    assert row["turns"] == 2   # 2 conversations x their second turn
    assert math.isfinite(row["overhead_p50_ms"]) and row["engine_ttft_p50_ms"] > 0
    later = [r for r in result["records"] if r["turn"] > 0]
    assert all(r["cached_tokens"] > 0 and r["ttft"] > 0 for r in later)

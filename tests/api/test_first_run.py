"""What a newcomer sees first (issue 18, item 9): CLI help without markup, --version, --model,
per-benchmark --help, quick benchmark runs kept out of the checkout, a demo table that says
"cold" instead of a meaningless speed-up, a visible model-load progress line, and a model_id that
names the dtype the engine runs in."""

from __future__ import annotations

import copy
import io
import json

import pytest

from radixkv import cli
from radixkv.api import demo


def _cli(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


def test_help_is_plain_text_and_version_exists(capsys):
    import radixkv

    code, text = _cli(capsys, "--help")
    assert code == 0 and "``" not in text and "demo" in text and "bench" in text
    code, text = _cli(capsys, "--version")
    assert code == 0 and text.strip() == f"radixkv {radixkv.__version__}"


def test_bench_name_help_shows_the_benchmarks_own_flags(capsys):
    code, text = _cli(capsys, "bench", "core", "--help")
    assert code == 0 and "--synthetic-only" in text and "``" not in text
    assert cli.main(["bench", "--help"]) == 0
    assert "NAME" in capsys.readouterr().out
    code, text = _cli(capsys, "bench", "kv-quant", "--help")
    assert code == 0 and "--tokens" in text and "``" not in text


@pytest.mark.parametrize("command", ["demo", "chat"])
def test_demo_and_chat_take_model(capsys, command, tmp_path):
    code, text = _cli(capsys, command, "--help")
    assert code == 0 and "--model" in text
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert demo.model_source(str(gguf)) == (str(tmp_path), "m.gguf")
    assert demo.model_source(str(tmp_path)) == (str(tmp_path), None)
    assert demo.model_source(None) == (None, None)
    with pytest.raises(SystemExit, match="neither"):
        demo.model_source(str(tmp_path / "missing"))


def test_quick_results_stay_out_of_the_checkout(tmp_path, monkeypatch, capsys):
    from radixkv.benchmarks import _common

    monkeypatch.delenv("RADIXKV_RESULTS_DIR", raising=False)
    monkeypatch.setattr(_common.tempfile, "gettempdir", lambda: str(tmp_path))
    repo_results = _common.REPO_ROOT / "benchmarks" / "results"

    def snapshot():
        return {p.name: p.stat().st_mtime_ns for p in repo_results.glob("*")}
    before = snapshot()
    for name, header in (("x_quick", {}), ("ttft-quick", {}), ("async_loads", {"quick": True})):
        path = _common.write_results(name, header, {"ok": 1})
        assert path.parent == tmp_path / "radixkv-bench-quick"
        assert json.loads(path.read_text())["results"] == {"ok": 1}
        assert "kept out of benchmarks/results" in capsys.readouterr().out
    assert snapshot() == before
    assert not _common.is_quick("core", {"quick": False})


def test_demo_marks_cold_turns_and_explains_speedup(capsys):
    rows = [demo._row("chat turn 1", 100, 0, 0.30, 0.10),      # noise: "0.3x" before
            demo._row("chat turn 2", 140, 96, 0.05, 0.20)]
    demo.print_rows(rows)
    text = capsys.readouterr().out
    assert "cold" in text and "0.3x" not in text and "4.0x" in text
    assert "cold" in demo.LEGEND and "speedup" in demo.LEGEND


def test_progress_line_for_slow_steps():
    buf = io.StringIO()
    with demo.progress("loading the model", file=buf, every_s=0.01):
        pass
    text = buf.getvalue()
    assert text.startswith("loading the model...") and "done in" in text


def test_model_id_names_the_dtype_the_engine_runs_in(tiny_model_shared, smol_tokenizer):
    import torch

    from radixkv.api.engine import Engine, default_model_id
    from radixkv.config import CacheConfig, EngineConfig

    model = copy.deepcopy(tiny_model_shared)
    assert "float32" in default_model_id(model)
    e = Engine(model, smol_tokenizer, CacheConfig(block_size=16, num_device_blocks=8),
               EngineConfig(dtype="bfloat16", device="cpu", max_model_len=256))
    assert "bfloat16" in e.model_id and "float32" not in e.model_id
    assert next(e.core.model.parameters()).dtype == torch.bfloat16

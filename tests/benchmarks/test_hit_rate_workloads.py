"""bench hit-rate --workloads on a tiny synthetic trace: rows, ratios, zone and verdicts."""

from __future__ import annotations

import json

from hitrate_strategies import loop

from radixkv.benchmarks import hit_rate_workloads as H
from radixkv.benchmarks.bounds import infinite, prepare, session_phantoms, simulate


def _evaluate_loop():
    reqs = loop(n_conv=4, turns=5, size=20)
    bt = prepare(reqs, H.BLOCK_SIZE)
    caps = H.capacity_grid(bt, 4)
    assert caps[0] == bt.min_capacity + 2 and caps == sorted(set(caps)) and len(caps) <= 4
    res = H.evaluate(reqs, {}, caps, ["lru", "mru", "forecast"])
    assert len(res["rows"]) == 3 * len(caps)
    inf = infinite(bt).hit_rate
    for r in res["rows"]:
        bel = simulate(bt, r["capacity_blocks"], "belady").hit_rate
        assert r["belady"] == bel and r["zone"] == (bel >= 0.5 * inf)
        assert r["end_blind"] == simulate(bt, r["capacity_blocks"], "end-blind",
                                          phantoms=session_phantoms(reqs)).hit_rate
        assert abs(r["of_belady"] - r["hit_rate"] / bel) < 1e-12
        assert abs(r["cost_of_ref"] * r["cost_ref"] - r["cost_rate"]) < 1e-12
        if r["policy"] == "lru":  # the real tree's LRU equals the block model's
            assert r["hit_rate"] == simulate(bt, r["capacity_blocks"], "lru").hit_rate
            assert r["points_vs_lru"] == 0.0
    assert set(H.verdicts(res["rows"])) == {"lru", "mru", "forecast"}
    zone = [r["end_blind"] / r["belady"] for r in res["rows"] if r["zone"]]
    assert res["end_blind_min_of_belady_in_zone"] == (min(zone) if zone else None)
    json.dumps(res)  # serialisable as written to benchmarks/results
    return res, reqs


def test_evaluate_rows_ratios_and_zone():
    _evaluate_loop()


def test_markdown_shows_the_end_blind_reference(tmp_path):
    res, reqs = _evaluate_loop()
    res.update(workload="loop", requests=len(reqs), verdicts=H.verdicts(res["rows"]))
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": {"workloads": [res]}}))
    lines = H.markdown(path, ["lru", "mru"]).splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("| blocks"))
    assert lines[head] == "| blocks (of working set) | Belady | end-blind | lru | mru |"
    assert lines[head + 1] == "|---|---|---|---|---|"
    r0 = res["rows"][0]
    assert lines[head + 2].split(" | ")[2] == (
        f"{r0['end_blind']:.3f} ({r0['end_blind'] / r0['belady']:.2f})")


def row(policy, of_belady, points, zone=True):
    return {"policy": policy, "of_belady": of_belady, "points_vs_lru": points, "zone": zone,
            "cost_of_ref": of_belady}


def test_verdicts_apply_both_halves_of_the_target():
    v = H.verdicts([row("a", 0.8, -1.0), row("a", 0.5, 0.0, zone=False),
                    row("b", 0.79, 5.0), row("c", 0.9, -1.01), row("d", 0.1, 0.0, False)])
    assert v["a"]["meets_target"] and v["a"]["min_of_belady_in_zone"] == 0.8
    assert not v["b"]["meets_target"] and not v["c"]["meets_target"]
    assert v["d"]["meets_target"] and v["d"]["min_of_belady_in_zone"] is None


def test_verdicts_say_whether_a_policy_is_fit_to_be_the_default():
    """Issue 30's bounds: >= LRU - 0.2 points everywhere, <= 1.3x LRU's CPU at the median."""
    def r(policy, cap, points, cpu):
        return {**row(policy, 0.9, points), "capacity_blocks": cap, "cpu_us_per_request": cpu}

    rows = [r("lru", c, 0.0, 100.0) for c in (1, 2, 3)]
    rows += [r("ok", 1, -0.2, 120.0), r("ok", 2, 3.0, 130.0), r("ok", 3, 0.0, 200.0)]
    rows += [r("low", 1, -0.21, 100.0), r("low", 2, 0.0, 100.0), r("low", 3, 0.0, 100.0)]
    rows += [r("dear", c, 1.0, 131.0) for c in (1, 2, 3)]
    v = H.verdicts(rows)
    assert v["lru"]["within_default_bounds"] and v["ok"]["within_default_bounds"]
    assert not v["low"]["within_default_bounds"] and not v["dear"]["within_default_bounds"]


def test_every_core_policy_is_benchmarked():
    from radixkv.core.policy_registry import POLICIES

    names = H.core_policies()
    assert names[:len(POLICIES)] == list(POLICIES)
    assert names[len(POLICIES):] == [f"{p}+end-hint" for p in H.END_HINT_POLICIES]


def test_baseline_core_replays_beside_this_one():
    """--baseline: every policy also replayed through an earlier commit's core (here HEAD's,
    so the same code): the rows carry its hit rate and CPU, and the hits agree request by
    request (the per-request digests), as do the verdicts."""
    from radixkv.benchmarks._core_baseline import load_core_parts

    base = load_core_parts("HEAD")
    assert base is not None, "needs a git checkout"
    assert base.RadixTree.__module__.startswith("radixkv_core_HEAD")
    reqs = loop(n_conv=4, turns=5, size=20)
    caps = H.capacity_grid(prepare(reqs, H.BLOCK_SIZE), 3)
    res = H.evaluate(reqs, {}, caps, ["lru", "duel"], baseline=base)
    assert len(res["rows"]) == 2 * len(caps)
    for r in res["rows"]:
        assert r["same_hits_as_baseline"] and r["baseline_hit_rate"] == r["hit_rate"]
        assert r["baseline_cpu_us_per_request"] > 0 and len(r["hits_digest"]) == 16
    v = H.verdicts(res["rows"])
    assert v["duel"]["same_hits_as_baseline"] and v["duel"]["cpu_vs_baseline_median"] > 0
    assert v["lru"]["cpu_vs_lru_median"] == v["lru"]["cpu_vs_lru_median_baseline"] == 1.0
    json.dumps(res)


def test_reused_references_give_the_same_rows():
    """``--reuse``: an earlier run's references at its capacities stand in for simulating them
    again; the rows are the same (the replays are deterministic)."""
    res, reqs = _evaluate_loop()
    refs = {r["capacity_blocks"]: r for r in res["rows"]}
    again = H.evaluate(reqs, {}, None, ["lru", "mru", "forecast"], references=refs)
    assert again["capacities"] == res["capacities"]
    drop = ("seconds", "cpu_us_per_request")
    assert [{k: v for k, v in r.items() if k not in drop} for r in again["rows"]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in res["rows"]]

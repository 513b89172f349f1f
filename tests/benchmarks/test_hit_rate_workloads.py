"""bench hit-rate --workloads on a tiny synthetic trace: rows, ratios, zone and verdicts."""

from __future__ import annotations

import json

from test_policy_sim import loop

from radixkv.benchmarks import hit_rate_workloads as H
from radixkv.benchmarks.bounds import infinite, prepare, simulate


def test_evaluate_rows_ratios_and_zone():
    reqs = loop(n_conv=4, turns=5, size=20)
    bt = prepare(reqs, H.BLOCK_SIZE)
    caps = H.capacity_grid(bt, 4)
    assert caps[0] == bt.min_capacity + 2 and caps == sorted(set(caps)) and len(caps) <= 4
    res = H.evaluate(reqs, {}, caps, ["lru", "mru"], ["next-use"])
    assert len(res["rows"]) == 3 * len(caps)
    inf = infinite(bt).hit_rate
    for r in res["rows"]:
        bel = simulate(bt, r["capacity_blocks"], "belady").hit_rate
        assert r["belady"] == bel and r["zone"] == (bel >= 0.5 * inf)
        assert abs(r["of_belady"] - r["hit_rate"] / bel) < 1e-12
        assert abs(r["cost_of_ref"] * r["cost_ref"] - r["cost_rate"]) < 1e-12
        if r["policy"] == "lru":  # the real tree's LRU equals the block model's
            assert r["hit_rate"] == simulate(bt, r["capacity_blocks"], "lru").hit_rate
            assert r["points_vs_lru"] == 0.0
    assert set(H.verdicts(res["rows"])) == {"lru", "mru", "next-use"}
    json.dumps(res)  # serialisable as written to benchmarks/results


def row(policy, of_belady, points, zone=True):
    return {"policy": policy, "of_belady": of_belady, "points_vs_lru": points, "zone": zone,
            "cost_of_ref": of_belady}


def test_verdicts_apply_both_halves_of_the_target():
    v = H.verdicts([row("a", 0.8, -1.0), row("a", 0.5, 0.0, zone=False),
                    row("b", 0.79, 5.0), row("c", 0.9, -1.01), row("d", 0.1, 0.0, False)])
    assert v["a"]["meets_target"] and v["a"]["min_of_belady_in_zone"] == 0.8
    assert not v["b"]["meets_target"] and not v["c"]["meets_target"]
    assert v["d"]["meets_target"] and v["d"]["min_of_belady_in_zone"] is None


def test_every_core_policy_is_benchmarked():
    from radixkv.core.policy import POLICIES

    names = H.core_policies()
    assert names[:len(POLICIES)] == list(POLICIES)
    assert names[len(POLICIES):] == [f"{p}+end-hint" for p in H.END_HINT_POLICIES]

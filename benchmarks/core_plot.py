"""The plot of ``radixkv bench core``: what the core costs as the cache grows.

Left, eviction per block against the number of cached blocks (this core, the baseline core of
the same run, and the floor: a dict pop in an index of that size); right, metadata bytes per
cached block (both cores, the 200 B target and the 80 B floor). Both against the same x axis,
because "flat as the cache grows" is the claim each panel checks.

``python -m radixkv.benchmarks.core_plot benchmarks/results/core.json [out.png]`` redraws it from
a results file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "img" / "bench_core.png"


def plot_core(results: dict, path: Path, title: str = "") -> Path:
    """Draw the two panels from a ``bench core`` results dict into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev, mem = results["eviction"], results["memory"]
    base = results.get("baseline_commit")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    n = [r["cached_blocks"] for r in ev]
    ax.plot(n, [r["us_per_block"] for r in ev], "o-", label="this core")
    if "before_us_per_block" in ev[0]:
        ax.plot(n, [r["before_us_per_block"] for r in ev], "s--", label=f"baseline ({base})")
    ax.plot(n, [r["floor_us"] for r in ev], ":", color="gray",
            label="floor: dict pop + list append")
    ax.axhline(1.0, color="red", linewidth=1, label="target <= 1 us")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("cached blocks")
    ax.set_ylabel("us per evicted block (CPU)")
    ax.set_title("eviction per block (lower, flatter is better)")
    ax.legend(fontsize=8)
    m = [r["cached_blocks"] for r in mem]
    bx.plot(m, [r["bytes_per_block"] for r in mem], "o-", label="this core")
    if "before_bytes_per_block" in mem[0]:
        bx.plot(m, [r["before_bytes_per_block"] for r in mem], "s--", label=f"baseline ({base})")
    bx.axhline(200, color="red", linewidth=1, label="target <= 200 B")
    bx.axhline(mem[0]["floor_bytes_per_block"], color="gray", linestyle=":",
               label="floor: hash + tokens")
    bx.set_xscale("log")
    bx.set_ylim(0, 260)
    bx.set_xlabel("cached blocks")
    bx.set_ylabel("bytes per cached block (pool included)")
    bx.set_title("metadata per block")
    bx.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__)
        return 2
    data = json.loads(Path(args[0]).read_text())
    header = data.get("header", {})
    out = Path(args[1]) if len(args) > 1 else DEFAULT_OUT
    print(plot_core(data["results"], out, f"radixkv bench core at {header.get('commit')}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

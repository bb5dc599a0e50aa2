#!/usr/bin/env python3
"""Plots of the testbed experiments (docs/experiments.md) from their JSON.

    scripts/plot-experiments.py docs/experiments/checksum.json docs/experiments/checksum.png

One column per link rate: throughput against the number of targets, conventional (the
client reads the blocks and computes) against offloaded (the targets compute), and below it
the bytes the client's link carried per byte of data, from the interfaces' counters.
Installs matplotlib with pip when it is missing.
"""
import json
import subprocess
import sys

try:
    import matplotlib
except ImportError:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "matplotlib"])
    import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rate_value(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, m in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * m
    return float("inf")


def main(src, dst):
    records = json.load(open(src))
    rates = sorted({r["rate"] for r in records}, key=rate_value)
    ops = sorted({r["op"] for r in records})
    fig, axes = plt.subplots(2, len(rates), figsize=(5.2 * len(rates), 6.4), squeeze=False, gridspec_kw={"height_ratios": [3, 2]})
    colors = {"conventional": "tab:red", "offloaded": "tab:blue"}
    markers = ["o", "s", "^", "D"]
    for col, rate in enumerate(rates):
        top, bottom = axes[0][col], axes[1][col]
        for i, op in enumerate(ops):
            for mode in ("conventional", "offloaded"):
                rs = sorted((r for r in records if r["rate"] == rate and r["op"] == op and r["mode"] == mode), key=lambda r: r["targets"])
                if not rs:
                    continue
                x = [r["targets"] for r in rs]
                label = f"{op} {mode}"
                style = "-" if mode == "offloaded" else "--"
                top.plot(x, [r["mb_per_s"] / 1000 for r in rs], style, marker=markers[i % 4], color=colors[mode], label=label)
                bottom.plot(x, [max(r["wire_fraction"], 1e-7) * 100 for r in rs], style, marker=markers[i % 4], color=colors[mode], label=label)
        link = rate_value(rate) / 8 / 1e9
        top.axhline(link, color="gray", linewidth=0.8, linestyle=":")
        top.text(1, link, f" link {rate}", color="gray", va="bottom", fontsize=8)
        top.set_title(f"links at {rate}")
        top.set_ylabel("throughput (GB/s)")
        top.set_xscale("log", base=2)
        top.set_xticks(sorted({r["targets"] for r in records}))
        top.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        top.set_ylim(bottom=0)
        top.grid(alpha=0.3)
        bottom.set_yscale("log")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(sorted({r["targets"] for r in records}))
        bottom.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        bottom.set_xlabel("targets")
        bottom.set_ylabel("client link bytes (% of data)")
        bottom.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8, loc="upper left")
    name = records[0]["experiment"] if records else ""
    fig.suptitle(f"{name}: conventional vs offloaded, 2-core machine, targets in network namespaces", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

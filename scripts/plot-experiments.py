#!/usr/bin/env python3
"""Plots of the testbed experiments (docs/experiments.md) from their JSON.

    scripts/plot-experiments.py docs/experiments/checksum.json docs/experiments/checksum.png
    scripts/plot-experiments.py docs/experiments/sort-size.json docs/experiments/sort-size.png

Checksum and select: one column per link rate: throughput against the number of targets, conventional (the
client reads the blocks and computes) against offloaded (the targets compute), and below it
the bytes the client's link carried per byte of data, from the interfaces' counters.
The sorts (sort-size, sort-rate, sort-devices): runtime of both transfers against the
grid's variable, and the merge phase split into its parts.
Volumes (volume, from scripts/exp-volume.py): one volume's bandwidth against the number of
targets it spans, per workload and link rate, exported by a target or by the client's own
target, with the goal of 0.8 x N times one target; volume-rebalance: the client's bandwidth
over time while `volume rebalance` moves extents onto a new target.
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


MODES = {"host-mediated": ("tab:red", "--", "host-mediated"), "device-to-device": ("tab:blue", "-", "device to device")}


def sort_plot(records, dst):
    name = records[0]["experiment"]
    if name == "sort-size":
        groups = [("", records)]
        xkey, xlabel, xlog = "bytes", "data size (bytes)", True
    elif name == "sort-rate":
        groups = [("", records)]
        xkey, xlabel, xlog = "rate", "link rate", True
    else:
        rates = sorted({r["rate"] for r in records}, key=rate_value)
        groups = [(f"links at {rate}", [r for r in records if r["rate"] == rate]) for rate in rates]
        xkey, xlabel, xlog = "targets", "targets", False
    fig, axes = plt.subplots(2, len(groups), figsize=(5.6 * len(groups), 7), squeeze=False)
    for col, (title, rs) in enumerate(groups):
        top, bottom = axes[0][col], axes[1][col]
        xs = sorted({r[xkey] for r in rs}, key=rate_value if xkey == "rate" else (lambda v: v))
        pos = {x: i for i, x in enumerate(xs)} if xkey == "rate" else None
        for mode, (color, style, label) in MODES.items():
            m = sorted((r for r in rs if r["transfer"] == mode), key=lambda r: pos[r[xkey]] if pos else r[xkey])
            x = [pos[r[xkey]] if pos else r[xkey] for r in m]
            top.plot(x, [r["secs"] for r in m], style, marker="o", color=color, label=f"{label}: whole sort")
            top.plot(x, [r["merge_phase_secs"] for r in m], style, marker="s", color=color, alpha=0.5, label=f"{label}: merge phase")
            width = 0.35 if pos else None
            if pos:
                off = -width / 2 if mode == "host-mediated" else width / 2
                bx = [v + off for v in x]
                # As the seed's figure 5.3: the share of the merge phase spent moving data.
                moved = [r["copy_secs"] if mode == "host-mediated" else r["merge_input_wait_secs"] for r in m]
                share = [min(c / r["merge_phase_secs"], 1) * 100 for r, c in zip(m, moved)]
                bottom.bar(bx, share, width, color=color, alpha=0.9, label=f"{label}: " + ("host copies" if mode == "host-mediated" else "merge waiting for peers' data"))
                bottom.bar(bx, [100 - v for v in share], width, bottom=share, color=color, alpha=0.3, label=f"{label}: merging")
            else:
                bottom.plot(x, [r["client_bytes"] / max(r["bytes"], 1) * 100 for r in m], style, marker="o", color=color, label=label)
        if pos:
            for ax in (top, bottom):
                ax.set_xticks(range(len(xs)))
                ax.set_xticklabels(xs)
            bottom.set_ylabel("share of the merge phase (%)")
            bottom.set_ylim(0, 135)
            top.set_yscale("log")
        else:
            bottom.set_ylabel("client link bytes (% of data)")
            bottom.set_yscale("log")
            if xlog:
                for ax in (top, bottom):
                    ax.set_xscale("log", base=2)
            top.set_yscale("log" if xlog else "linear")
            if not xlog:
                for ax in (top, bottom):
                    ax.set_xticks(xs)
        top.set_ylabel("seconds (median of runs)")
        top.set_title(title or name)
        top.grid(alpha=0.3, which="both")
        bottom.grid(alpha=0.3, which="both")
        bottom.set_xlabel(xlabel)
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    output = "one output per target (key ranges)" if records[0].get("output") == "ranges" else "one output"
    fig.suptitle(f"{name}, {output}:\ndevice to device vs host-mediated, 2-core machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


EXPORTS = {"target": ("tab:red", "--", "exported by t1"), "client": ("tab:blue", "-", "exported by the client's target")}


def volume_plot(records, dst):
    rates = sorted({r["rate"] for r in records}, key=rate_value)
    workloads = [w for w in ("read", "write", "randread", "randwrite") if any(r["workload"] == w for r in records)]
    fig, axes = plt.subplots(len(rates), len(workloads), figsize=(3.4 * len(workloads), 3.2 * len(rates)), squeeze=False)
    for row, rate in enumerate(rates):
        for col, w in enumerate(workloads):
            ax = axes[row][col]
            rs = [r for r in records if r["rate"] == rate and r["workload"] == w]
            xs = sorted({r["targets"] for r in rs})
            for where, (color, style, label) in EXPORTS.items():
                m = sorted((r for r in rs if r["export"] == where), key=lambda r: r["targets"])
                ax.plot([r["targets"] for r in m], [r["mb_per_s"] for r in m], style, marker="o", color=color, label=label)
            one = [r["mb_per_s"] for r in rs if r["targets"] == 1 and r["export"] == "target"]
            if one:
                ax.plot(xs, [0.8 * x * one[0] for x in xs], ":", color="gray", label="goal: 0.8 x N x one target")
            link = rate_value(rate) / 8 / 1e6
            ax.axhline(link, color="gray", linewidth=0.6, linestyle="-.")
            ax.set_title(f"{w}, links {rate}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if col == 0:
                ax.set_ylabel("MB/s")
            if row == len(rates) - 1:
                ax.set_xlabel("targets the volume spans")
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.suptitle("one volume, 128 KiB I/O: bandwidth against targets (dash-dot: one link), 2-core machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=80)


def rebalance_plot(records, dst):
    r = records[0]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot([s["t"] for s in r["samples"]], [s["mb_per_s"] for s in r["samples"]], "-", marker=".", color="tab:blue", label="client's sequential reads")
    ax.axvspan(r["rebalance_start"], r["rebalance_end"], color="tab:orange", alpha=0.2,
               label=f"rebalance: {len(r['moves'])} moves in {r['rebalance_secs']:.1f} s")
    ax.axhline(rate_value(r["rate"]) / 8 / 1e6, color="gray", linewidth=0.6, linestyle="-.", label=f"one link ({r['rate']})")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB/s (each second)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"volume rebalance under load: extents {r['extents_before']} -> {r['extents_after']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=80)


def fair_plot(records, dst):
    import statistics
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.4), gridspec_kw={"width_ratios": [2, 3]})
    victim = [r for r in records if r["experiment"] == "interference" and r["tenant"] == "victim"]
    bars = [("alone", [r for r in victim if r["case"] == "alone"])]
    bars += [(f"scheduler {s}", [r for r in victim if r["case"] == "contended" and r["scheduler"] == s]) for s in ("off", "on")]
    for i, (label, rs) in enumerate(bars):
        for j, (q, color) in enumerate((("p50_us", "tab:blue"), ("p99_us", "tab:red"))):
            v = statistics.median(r[q] for r in rs) / 1000
            left.bar(i + (j - 0.5) * 0.38, v, 0.38, color=color, label=q[:3] if i == 0 else None)
            left.text(i + (j - 0.5) * 0.38, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6)
    left.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("victim's 4 KiB read latency, ms")
    left.set_title("interference: 2 tenants' 128 KiB QD 32 behind", fontsize=8)
    left.legend(fontsize=7)
    share = [r for r in records if r["experiment"] == "sharing"]
    cases = sorted({r["case"] for r in share})
    x = 0
    ticks = []
    for case in cases:
        for wa in (100, 200):
            for k, s in enumerate(("off", "on")):
                sel = [r for r in share if r["case"] == case and r["weights"]["a"] == wa and r["scheduler"] == s]
                shares = []
                for rnd in sorted({r["round"] for r in sel}):
                    bw = {r["tenant"]: r["mb_per_s"] for r in sel if r["round"] == rnd}
                    shares.append(bw["a"] / (bw["a"] + bw["b"]))
                right.bar(x + k * 0.4, statistics.median(shares), 0.4, color="tab:gray" if s == "off" else "tab:green",
                          label=f"scheduler {s}" if x == 0 else None)
            want = 0.5 if wa == 100 else 2 / 3
            right.plot([x - 0.2, x + 0.6], [want, want], "k-", linewidth=1)
            ticks.append((x + 0.2, f"{case}\n{wa // 100}:1"))
            x += 1.2
    right.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=7)
    right.set_ylim(0, 1)
    right.set_ylabel("tenant a's share of the bandwidth")
    right.set_title("sharing (black: the weights' share)", fontsize=8)
    right.legend(fontsize=7)
    fig.suptitle(f"fair I/O on one target, device {records[0].get('rate', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=80)


def main(src, dst):
    records = json.load(open(src))
    if records and records[0].get("experiment") in ("interference", "sharing"):
        return fair_plot(records, dst)
    if records and records[0].get("experiment") == "volume":
        return volume_plot(records, dst)
    if records and records[0].get("experiment") == "volume-rebalance":
        return rebalance_plot(records, dst)
    if records and str(records[0].get("experiment", "")).startswith("sort-"):
        return sort_plot(records, dst)
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

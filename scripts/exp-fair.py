#!/usr/bin/env python3
"""Flint's fairness experiments on one target (issue 16; docs/experiments.md, "Experiment 5").

One `nearstore target` serves a memory namespace behind a device of RATE bytes per second
(`rate_limit`, dev/rate.rs: one timeline for every queue, so the tenants really contend for
it, as for a drive), with the fair I/O scheduler (`fair = { bandwidth = RATE }`) on or off;
every tenant is a configured `[[tenant]]` with its own host NQN and `io_weight`, and runs
`nearstore perf` as that host, all tenants' perf processes started together for SECS.

- interference: a victim's 4 KiB random reads at QD 1 alone, then beside two background
  tenants (128 KiB sequential reads and 128 KiB sequential writes, QD 32 each), the
  scheduler off and on: the victim's p50/p99 against alone (goal: p99 within 1.5x of alone
  with it on).
- sharing: pairs S1 (4 KiB random reads vs 128 KiB reads), S2 (128 KiB reads vs 128 KiB
  writes), S3 (4 KiB random 70% reads vs 4 KiB random 70% writes), each at QD 32, with
  equal weights (Jain's index of the two bandwidths; goal >= 0.98) and 2:1 weights (the
  first tenant's share; goal within 5% of 2/3), the scheduler off and on.
- compute (FusionFS): one compute thread (`[compute] threads = 1`), no device limit; a light
  tenant's grep and select over 64 KiB (`nearstore-lab compute-load --kind light`) alone and
  beside a heavy tenant's four sha256 commands over 64 MiB at a time (goal: the light one's
  p99 within 1.5x of alone), back to back and with THINK_MS between its commands; then two heavy tenants at equal compute weights, then 2:1: the
  CPU time the target measured for each (its metrics), goal within 5% of the weights.

Every run is bounded (perf -T SECS, killed after SECS + 30 s); the target is stopped by PID
on any exit. Writes a JSON list to --out (one object per tenant per run; plot it with
scripts/plot-experiments.py) and prints tables.
Usage: python3 scripts/exp-fair.py [--bin target/release/nearstore] [--rate 64MiB]
       [--share 1.0] [--secs 5] [--rounds 3] [--only interference|sharing] --out FILE
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NQN = "nqn.2026-11.io.nearstore:fair"
PORT = 44231


def host(tenant):
    return f"nqn.2014-08.org.nvmexpress:uuid:exp-fair-{tenant}"


def size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


def compute_config(weights, chunk=None):
    lines = [
        f'metrics = "127.0.0.1:{PORT + 1}"',
        "[compute]",
        "threads = 1",
    ] + ([f'chunk = "{chunk}"'] if chunk else []) + [
        "[[listener]]",
        f'address = "127.0.0.1:{PORT}"',
        "[[subsystem]]",
        f'nqn = "{NQN}"',
        "allow_any_host = true",
        "[[subsystem.namespace]]",
        "nsid = 1",
        'memory = "1GiB"',
        "block_size = 4096",
    ]
    for name, weight in weights.items():
        lines += ["[[tenant]]", f'name = "{name}"', f'hosts = ["{host(name)}"]', f"compute_weight = {weight}",
                  "[[tenant.reach]]", f'subsystem = "{NQN}"']
    return "\n".join(lines) + "\n"


def cpu_ns():
    """Each tenant's compute CPU time the target measured (its metrics endpoint)."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT + 1}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("nearstore_tenant_compute_cpu_nanoseconds_total{"):
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            out[tenant] = float(line.split()[-1])
    return out


# tenant -> (kind, offset, bytes, concurrency)
# The light tenant's pause after each command in the "thinking" cases, in milliseconds: a
# tenant that asks for a small part of the engine (about a tenth of it alone), as FusionFS's
# light tenant; without it the light tenant asks for most of the engine back to back, and
# equal shares halve what it gets.
THINK_MS = 10
LOADS = {"light": ("light", "0", "64KiB", 1), "heavy": ("heavy", "16MiB", "64MiB", 4), "heavy2": ("heavy", "128MiB", "64MiB", 4)}


def compute_all(binary, tenants, secs, think_ms=0):
    lab = os.path.join(os.path.dirname(binary), "nearstore-lab")
    procs = []
    for t in tenants:
        kind, off, n, c = LOADS[t]
        think = think_ms if kind == "light" else 0
        cmd = ["taskset", "-c", "1", lab, "compute-load", "-a", f"127.0.0.1:{PORT}", "-n", NQN, "--hostnqn", host(t),
               "--kind", kind, "--offset", off, "--bytes", n, "-c", str(c), "-T", str(secs), "-o", "json",
               "--think-ms", str(think)]
        procs.append((t, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    return collect("compute-load", procs, secs + 120)


def collect(verb, procs, limit):
    """The JSON each (tenant, process) printed, by tenant; waits at most `limit` s for all
    of them and ends the experiment, killing what is left of it, if one fails or overruns."""
    out = {}
    deadline = time.monotonic() + limit

    def end(why):
        for _, q in procs:
            q.kill()
        sys.exit(why)

    for tenant, p in procs:
        try:
            o, e = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            end(f"{verb} of {tenant} did not end within {limit} s")
        if p.returncode != 0:
            end(f"{verb} of {tenant} failed: {e}")
        out[tenant] = json.loads(o)
    return out


def config(rate, fair, weights, share=1.0):
    lines = [
        "[[listener]]",
        f'address = "127.0.0.1:{PORT}"',
        "[[subsystem]]",
        f'nqn = "{NQN}"',
        "allow_any_host = true",
        "[[subsystem.namespace]]",
        "nsid = 1",
        'memory = "1GiB"',
        "block_size = 4096",
        f'rate_limit = "{rate}"',
    ]
    if fair:
        lines.append(f'fair = {{ bandwidth = "{int(size(rate) * share)}" }}')
    for name, weight in weights.items():
        lines += [
            "[[tenant]]",
            f'name = "{name}"',
            f'hosts = ["{host(name)}"]',
            f"io_weight = {weight}",
            "[[tenant.reach]]",
            f'subsystem = "{NQN}"',
        ]
    return "\n".join(lines) + "\n"


class Target:
    def __init__(self, binary, work, cfg):
        path = os.path.join(work, "t.toml")
        with open(path, "w") as f:
            f.write(cfg)
        self.log = os.path.join(work, "t.out")
        self.proc = subprocess.Popen(
            ["taskset", "-c", "0", binary, "target", "--config", path, "--discovery", "none", "--net-threads", "1",
             "--busy-poll-us", "0", "--log-level", "warn"],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        for _ in range(100):
            if "listening" in open(self.log).read():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        sys.exit("the target did not start:\n" + open(self.log).read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def perf_all(binary, specs, secs):
    """Runs one perf per (tenant, workload, size, qd, mix) at once; their JSON results."""
    procs = []
    for tenant, workload, size, qd, mix in specs:
        cmd = ["taskset", "-c", "1", binary, "perf", "-a", f"127.0.0.1:{PORT}", "-n", NQN, "--hostnqn", host(tenant),
               "-w", workload, "-z", size, "-q", str(qd), "-T", str(secs), "--busy-poll-us", "0", "--quiet", "-o", "json"]
        if mix is not None:
            cmd += ["-M", str(mix)]
        procs.append((tenant, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    return collect("perf", procs, secs + 30)


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


INTERFERENCE = {
    "alone": [("victim", "randread", "4KiB", 1, None)],
    "contended": [("victim", "randread", "4KiB", 1, None), ("bgread", "read", "128KiB", 32, None),
                  ("bgwrite", "write", "128KiB", 32, None)],
}
PAIRS = {
    "S1": [("a", "randread", "4KiB", 32, None), ("b", "read", "128KiB", 32, None)],
    "S2": [("a", "read", "128KiB", 32, None), ("b", "write", "128KiB", 32, None)],
    "S3": [("a", "randrw", "4KiB", 32, 70), ("b", "randrw", "4KiB", 32, 30)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="target/release/nearstore")
    ap.add_argument("--rate", default="64MiB", help="the device's bandwidth (rate_limit and fair)")
    ap.add_argument("--share", type=float, default=1.0,
                    help="the scheduler's bandwidth as a fraction of the device's (below 1: the device's queue stays short)")
    ap.add_argument("--secs", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True, help="JSON: a list of one object per tenant per run")
    ap.add_argument("--only", choices=["interference", "sharing", "compute"], help="one of the three")
    ap.add_argument("--compute-chunk", help="compute.chunk of the compute experiment's target (default: the target's)")
    a = ap.parse_args()
    rows = []
    work = tempfile.mkdtemp(prefix="nearstore-exp-fair.")
    print(f"# {time.strftime('%F %H:%M', time.gmtime())} UTC, {os.cpu_count()} cores, {a.bin}, device {a.rate}/s, "
          f"scheduler's bandwidth {a.share:g} of it, "
          f"{a.rounds} rounds of {a.secs} s", flush=True)

    def run(experiment, case, fair, weights, specs, r):
        t = Target(a.bin, work, config(a.rate, fair, weights, a.share))
        try:
            res = perf_all(a.bin, specs, a.secs)
        finally:
            t.stop()
        for tenant, j in res.items():
            row = {"experiment": experiment, "case": case, "scheduler": "on" if fair else "off", "round": r,
                   "weights": weights, "tenant": tenant, "rate": a.rate, "share": a.share, **j}
            rows.append(row)
            print(f"  {experiment} {case} {row['scheduler']} {weights} {tenant}: {j['mb_per_s']:.1f} MB/s, "
                  f"{j['iops']:.0f} IOPS, p50 {j['p50_us']:.0f} us, p99 {j['p99_us']:.0f} us", flush=True)

    def run_compute(case, weights, tenants, r, think_ms=0):
        t = Target(a.bin, work, compute_config(weights, a.compute_chunk))
        try:
            before = cpu_ns()
            res = compute_all(a.bin, tenants, a.secs, think_ms)
            after = cpu_ns()
        finally:
            t.stop()
        for tenant, j in res.items():
            cpu = after.get(tenant, 0) - before.get(tenant, 0)
            row = {"experiment": "compute", "case": case, "round": r, "weights": weights, "tenant": tenant,
                   "cpu_ns": cpu, **j}
            rows.append(row)
            print(f"  compute {case} {weights} {tenant}: {j['ops']} commands, p50 {j['p50_us']:.0f} us, "
                  f"p99 {j['p99_us']:.0f} us, CPU {cpu / 1e9:.2f} s", flush=True)

    try:
        for r in range(a.rounds):
            if a.only in (None, "compute"):
                w = {"light": 100, "heavy": 100, "heavy2": 100}
                run_compute("alone", w, ["light"], r)
                run_compute("contended", w, ["light", "heavy"], r)
                run_compute("alone, thinking", w, ["light"], r, THINK_MS)
                run_compute("contended, thinking", w, ["light", "heavy"], r, THINK_MS)
                run_compute("equal", w, ["heavy", "heavy2"], r)
                run_compute("2:1", {"light": 100, "heavy": 200, "heavy2": 100}, ["heavy", "heavy2"], r)
            if a.only == "compute":
                continue
            if a.only != "sharing":
                w = {"victim": 100, "bgread": 100, "bgwrite": 100}
                run("interference", "alone", True, w, INTERFERENCE["alone"], r)
                for fair in ([False, True] if r % 2 == 0 else [True, False]):
                    run("interference", "contended", fair, w, INTERFERENCE["contended"], r)
            if a.only != "interference":
                for case, specs in PAIRS.items():
                    for weights in ({"a": 100, "b": 100}, {"a": 200, "b": 100}):
                        for fair in ([False, True] if r % 2 == 0 else [True, False]):
                            run("sharing", case, fair, weights, specs, r)
    finally:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=0)
    summarize(rows)


def summarize(rows):
    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    inter = [x for x in rows if x["experiment"] == "interference" and x["tenant"] == "victim"]
    if inter:
        alone = [x for x in inter if x["case"] == "alone"]
        print("# interference: the victim's 4 KiB reads at QD 1 (medians over rounds)")
        a99, a50 = med([x["p99_us"] for x in alone]), med([x["p50_us"] for x in alone])
        print(f"alone: p50 {a50:.0f} us, p99 {a99:.0f} us")
        for s in ("off", "on"):
            c = [x for x in inter if x["case"] == "contended" and x["scheduler"] == s]
            p99, p50 = med([x["p99_us"] for x in c]), med([x["p50_us"] for x in c])
            print(f"contended, scheduler {s}: p50 {p50:.0f} us, p99 {p99:.0f} us: p99 {p99 / a99:.2f}x alone")
    comp = [x for x in rows if x["experiment"] == "compute"]
    if comp:
        print("# compute: the light tenant's grep/select latency (medians over rounds); heavy tenants' CPU")
        cases = ("alone", "contended", "alone, thinking", "contended, thinking")
        light = {c: [x for x in comp if x["case"] == c and x["tenant"] == "light"] for c in cases}
        for c, xs in light.items():
            a99 = med([x["p99_us"] for x in light["alone, thinking" if "thinking" in c else "alone"]])
            p99 = med([x["p99_us"] for x in xs])
            cpu = med([x["cpu_ns"] / 1e9 for x in xs])
            print(f"light {c}: p50 {med([x['p50_us'] for x in xs]):.0f} us, p99 {p99:.0f} us ({p99 / a99:.2f}x alone), "
                  f"CPU {cpu:.2f} s")
        for case in ("equal", "2:1"):
            ratios = []
            for r in sorted({x["round"] for x in comp if x["case"] == case}):
                cpu = {x["tenant"]: x["cpu_ns"] for x in comp if x["case"] == case and x["round"] == r}
                ratios.append(cpu["heavy"] / cpu["heavy2"])
            want = 1.0 if case == "equal" else 2.0
            print(f"heavy / heavy2 CPU at weights {case}: {med(ratios):.3f} (wanted {want:.1f})")
    share = [x for x in rows if x["experiment"] == "sharing"]
    if share:
        print("# sharing: MB/s of a, b (medians over rounds); equal weights: Jain's index; 2:1: a's share")
        for case in PAIRS:
            for wa in (100, 200):
                for s in ("off", "on"):
                    sel = [x for x in share if x["case"] == case and x["scheduler"] == s and x["weights"]["a"] == wa]
                    rounds = sorted({x["round"] for x in sel})
                    ja, shares, ma, mb = [], [], [], []
                    for r in rounds:
                        bw = {x["tenant"]: x["mb_per_s"] for x in sel if x["round"] == r}
                        ma.append(bw["a"])
                        mb.append(bw["b"])
                        ja.append(jain([bw["a"], bw["b"]]))
                        shares.append(bw["a"] / (bw["a"] + bw["b"]))
                    what = f"Jain {med(ja):.3f}" if wa == 100 else f"a's share {med(shares):.3f} (2:1 wants 0.667)"
                    print(f"{case} weights {wa}:100 scheduler {s}: {med(ma):.1f}, {med(mb):.1f} MB/s; {what}")


if __name__ == "__main__":
    main()

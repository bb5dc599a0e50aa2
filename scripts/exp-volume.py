#!/usr/bin/env python3
"""Flint's volume figures on the testbed (docs/experiments.md, "Experiment 4: volumes").

    sudo python3 scripts/exp-volume.py --out docs/experiments
    python3 scripts/plot-experiments.py docs/experiments/volume.json docs/experiments/volume.png
    python3 scripts/plot-experiments.py docs/experiments/volume-rebalance.json docs/experiments/volume-rebalance.png

Brings up `nearstore-lab testbed` (its namespaces and shaped links), then on it a control plane
and one member target per host with a pool (port 4421, beside the testbed's own targets, which
stay idle): `tK` in each target host, and one in the client host whose pool is cordoned, so
that it holds no extent and only exports. Then, per link rate and number of targets N, one
volume whose extents are allocated over the pools of t1..tN only (the others cordoned), read
and written by `nearstore perf` in the client host, exported two ways:

- `target`: by t1, the way a volume is exported to a host on another machine; every byte the
  client moves crosses t1's link, and t1 forwards the extents of its peers over the same link;
- `client`: by the target in the client host itself, which reaches each pool over that pool's
  link, as Flint's client reaches each drive (perf connects to it over loopback).

The client's own link is left unshaped: a Flint client's link is not the limit, the targets'
links are. Each run is SECS seconds of sequential and random 128 KiB reads and writes.

Then a rebalance under load: a volume on t1 alone, exported by the client's target, read
sequentially while t2's pool is uncordoned and `volume rebalance --wait` moves half of the
extents onto it; perf's bandwidth every second and the moves' times are recorded.

Everything made is taken down on any failure: the processes by PID, then the testbed
(`nearstore-lab testbed down`: namespaces, loop devices, mounts), then the work directory.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

CONTROL = "10.77.0.10:9470"
CLIENT_NS = "nstb-client"
PORT = 4421
MEMBER = "nqn.2026-11.io.nearstore:volexp-{}"
EXTENT = 8 << 20


def addr(host):
    """The member target's address: the client's is 10.77.0.10, tK's 10.77.0.(10+K)."""
    return f"10.77.0.{10 if host == 'client' else 10 + int(host[1:])}:{PORT}"


class Lab:
    def __init__(self, a):
        self.a = a
        self.bin = os.path.join(a.bin, "nearstore")
        self.lab = os.path.join(a.bin, "nearstore-lab")
        self.work = None
        self.procs = []  # (name, Popen): stopped by PID, newest first
        self.testbed = False

    def run(self, *args, ns=CLIENT_NS, check=True):
        cmd = (["ip", "netns", "exec", ns] if ns else []) + [str(x) for x in args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
        return r.stdout

    def cli(self, *args):
        return self.run(self.bin, *args, "--control", CONTROL)

    def api(self, *paths):
        """POSTs to the control plane's API, in one process: it listens in the client's
        namespace, so it is reached from there."""
        self.run("python3", "-c",
                 "import sys, urllib.request\n"
                 "for p in sys.argv[1:]:\n"
                 f"    urllib.request.urlopen(urllib.request.Request('http://{CONTROL}' + p, method='POST'), timeout=10).read()",
                 *paths)

    def spawn(self, name, ns, args, ready):
        log = open(os.path.join(self.work, f"{name}.log"), "w")
        p = subprocess.Popen(["ip", "netns", "exec", ns, *map(str, args)], stdout=subprocess.PIPE, stderr=log, text=True)
        # `ip netns exec` execs the command: the PID is the product's process.
        self.procs.append((name, p))
        deadline = time.time() + 20
        seen = []
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            seen.append(line)
            if ready in line:
                # Keep reading its stdout so that it never blocks on a full pipe.
                threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
                return p
        raise RuntimeError(f"{name} did not start: {''.join(seen)}{open(log.name).read()}")

    def up(self):
        self.work = tempfile.mkdtemp(prefix="nearstore-volexp-", dir=self.a.dir)
        n = max(self.a.targets + [2])
        self.testbed = True
        subprocess.run([self.lab, "testbed", "up", "--targets", str(n), "--files", "1", "--file-size", "1MiB",
                        "--rate", self.a.rates[0], "--dir", os.path.join(self.work, "tb")], check=True,
                       stdout=subprocess.DEVNULL)
        self.spawn("control", CLIENT_NS, [self.bin, "control", "--store", os.path.join(self.work, "store"), "--listen", CONTROL],
                   "listening")
        hosts = ["client"] + [f"t{k}" for k in range(1, n + 1)]
        members = ", ".join(f'"{MEMBER.format(h)}"' for h in hosts)
        for h in hosts:
            cfg = os.path.join(self.work, f"{h}.toml")
            with open(cfg, "w") as f:
                f.write(f'[[listener]]\naddress = "{addr(h)}"\n[[subsystem]]\nnqn = "nqn.2026-11.io.nearstore:volexp-{h}-mem"\n'
                        f'allow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\nmemory = "1MiB"\n'
                        f'[cluster]\nhost_nqn = "{MEMBER.format(h)}"\ntrusted_members = [{members}]\n')
            size = "64MiB" if h == "client" else f"{max(self.a.volume_mib, self.a.rebalance_mib) * 2}MiB"
            ns = CLIENT_NS if h == "client" else f"nstb-{h}"
            self.spawn(h, ns, [self.bin, "target", "--config", cfg, "--discovery", "none", "--log-level", "warn",
                               "--control", CONTROL, "--pool", f"{os.path.join(self.work, 'pool-' + h)}:{size}"], "listening")
        # Every pool registered and viewed (a pool without a view is not placed on).
        deadline = time.time() + 30
        while True:
            view = json.loads(self.cli("view", "-o", "json"))
            if len(view.get("pools", [])) == len(hosts):
                break
            if time.time() > deadline:
                raise RuntimeError(f"the pools did not all register: {view}")
            time.sleep(0.2)
        self.pools = {h: (addr(h), f"pool-{h}") for h in hosts}

    def only(self, n):
        """Extents may be placed on t1..tN only."""
        self.api(*(f"/v1/pools/{target}/{pool}/{'uncordon' if h != 'client' and int(h[1:]) <= n else 'cordon'}"
                   for h, (target, pool) in self.pools.items()))

    def volume(self, name, mib):
        """A volume of `mib` MiB, every extent allocated (placed over the uncordoned pools) and
        marked written: reads then reach the pools, not the unallocated path's zeros."""
        self.cli("volume", "create", name, "--size", f"{mib}MiB", "--extent-size", str(EXTENT))
        self.api(*(f"/v1/volumes/{name}/extents/{i}/{step}" for i in range(mib * (1 << 20) // EXTENT)
                   for step in ("allocate", "written")))
        return self.spread(name)

    def spread(self, name):
        info = json.loads(self.cli("volume", "info", name, "-o", "json"))
        by = {}
        for e in info["extents"]:
            by[e["target"]] = by.get(e["target"], 0) + 1
        return dict(sorted(by.items()))

    def export(self, name, where):
        self.cli("volume", "unexport", name)
        self.cli("volume", "export", name, "--target", addr(where), "--allow-any-host")
        # The exporter learns it by its long poll: wait until it serves.
        deadline = time.time() + 20
        while self.perf(name, where, "read", 0.1, quiet=True, check=False) is None:
            if time.time() > deadline:
                raise RuntimeError(f"{where} did not serve volume {name}")
            time.sleep(0.1)

    def perf_args(self, name, where, workload, secs, quiet):
        a = [self.bin, "perf", "-a", addr(where), "-n", f"nqn.2026-11.io.nearstore:volume:{name}", "-w", workload,
             "-z", "128KiB", "-q", str(self.a.qd), "--queues", str(self.a.queues), "-T", str(secs), "-o", "json"]
        return a + (["--quiet"] if quiet else [])

    def perf(self, name, where, workload, secs, quiet=True, check=True):
        r = subprocess.run(["ip", "netns", "exec", CLIENT_NS] + self.perf_args(name, where, workload, secs, quiet),
                           capture_output=True, text=True)
        if r.returncode != 0:
            if check:
                raise RuntimeError(f"perf {workload} on {name} via {where}: {r.stderr.strip()}")
            return None
        return json.loads(r.stdout)

    def links(self):
        """(rx, tx) bytes of every host's link."""
        out = {}
        for h in self.pools:
            s = json.loads(self.run("ip", "-j", "-s", "link", "show", "dev", "eth0", ns=f"nstb-{h}"))[0]["stats64"]
            out[h] = (s["rx"]["bytes"], s["tx"]["bytes"])
        return out

    def shape(self, rate):
        subprocess.run([self.lab, "testbed", "shape", "--rate", rate], check=True)
        # The client's link unshaped, both ways: the targets' links are the limit.
        self.run("tc", "qdisc", "del", "dev", "eth0", "root")
        self.run("tc", "qdisc", "del", "dev", "p-client", "root", ns="nstb-sw")

    def sweep(self):
        records = []
        for rate in self.a.rates:
            self.shape(rate)
            for n in self.a.targets:
                name = f"v{n}-{rate}"
                self.only(n)
                spread = self.volume(name, self.a.volume_mib)
                for where in ("target", "client"):
                    self.export(name, "t1" if where == "target" else "client")
                    for w in self.a.workloads:
                        before = self.links()
                        r = self.perf(name, "t1" if where == "target" else "client", w, self.a.secs)
                        after = self.links()
                        rec = {"experiment": "volume", "rate": rate, "targets": n, "export": where, "workload": w,
                               "io_size": r["io_size"], "queue_depth": r["queue_depth"], "queues": r["queues"],
                               "secs": r["seconds"], "bytes": r["ios"] * r["io_size"], "mb_per_s": r["mb_per_s"], "iops": r["iops"], "avg_us": r["avg_us"],
                               "extents": spread,
                               "links": {h: [after[h][0] - before[h][0], after[h][1] - before[h][1]] for h in after}}
                        records.append(rec)
                        print(f"{rate:>7} {n} targets, exported by {where:<6} {w:<9} {r['mb_per_s']:8.1f} MB/s", file=sys.stderr)
                self.cli("volume", "unexport", name)
                self.cli("volume", "delete", name)
        return records

    def rebalance(self):
        rate = self.a.rates[0]
        self.shape(rate)
        self.only(1)
        name = "rebalance"
        spread = self.volume(name, self.a.rebalance_mib)
        self.export(name, "client")
        samples = []
        p = subprocess.Popen(["ip", "netns", "exec", CLIENT_NS] + self.perf_args(name, "client", "read", 3600, False),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.procs.append(("perf", p))
        t0 = time.time()

        def progress():
            for line in p.stderr:
                # perf:    3 s     812 IOPS     106.4 MB/s
                f = line.split()
                if len(f) >= 6 and f[0] == "perf:" and f[-1] == "MB/s":
                    samples.append({"t": round(time.time() - t0, 3), "mb_per_s": float(f[-2])})
        reader = threading.Thread(target=progress, daemon=True)
        reader.start()
        time.sleep(self.a.before)
        self.only(2)
        start = time.time() - t0
        out = self.cli("volume", "rebalance", name, "--wait", "--max-bps", self.a.max_bps, "-o", "json")
        end = time.time() - t0
        time.sleep(self.a.before)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
        reader.join(timeout=5)
        moves = json.loads(out)["moves"]
        after = self.spread(name)
        print(f"rebalance: {len(moves)} moves in {end - start:.2f} s, {spread} -> {after}", file=sys.stderr)
        self.cli("volume", "unexport", name)
        return {"experiment": "volume-rebalance", "rate": rate, "extent_size": EXTENT, "max_bps": self.a.max_bps,
                "workload": "read", "io_size": 128 << 10, "queue_depth": self.a.qd, "queues": self.a.queues,
                "rebalance_start": round(start, 3), "rebalance_end": round(end, 3), "rebalance_secs": round(end - start, 3),
                "extents_before": spread, "extents_after": after, "moves": moves, "samples": samples}

    def down(self):
        errors = []
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.testbed:
            r = subprocess.run([self.lab, "testbed", "down"], capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"testbed down: {r.stderr.strip()}")
        if self.work:
            shutil.rmtree(self.work, ignore_errors=True)
        if errors:
            raise RuntimeError("; ".join(errors))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release", help="directory of nearstore and nearstore-lab")
    ap.add_argument("--targets", default="1,2,4,8", help="numbers of targets to spread a volume over")
    ap.add_argument("--rates", default="1gbit,10gbit", help="the targets' link rates (tc)")
    ap.add_argument("--workloads", default="read,write,randread,randwrite", help="perf's workloads")
    ap.add_argument("--secs", type=float, default=3, help="seconds per run")
    ap.add_argument("--qd", type=int, default=32, help="commands in flight per queue")
    ap.add_argument("--queues", type=int, default=2, help="perf's queues")
    ap.add_argument("--volume-mib", type=int, default=512, help="the volume's size (extents of 8 MiB)")
    ap.add_argument("--rebalance-mib", type=int, default=256, help="the rebalanced volume's size")
    ap.add_argument("--max-bps", default="64MiB", help="the rebalance's cap per move")
    ap.add_argument("--before", type=float, default=4, help="seconds of load before and after the rebalance")
    ap.add_argument("--no-rebalance", action="store_true", help="only the bandwidth sweep")
    ap.add_argument("--no-sweep", action="store_true", help="only the rebalance")
    ap.add_argument("--dir", default="/var/tmp", help="where the work directory (pools, testbed) goes")
    ap.add_argument("--out", required=True, help="directory for volume.json and volume-rebalance.json")
    a = ap.parse_args()
    a.targets = [int(x) for x in a.targets.split(",")]
    a.rates = a.rates.split(",")
    a.workloads = a.workloads.split(",")
    if os.geteuid() != 0:
        sys.exit("the testbed needs root (network namespaces, loop devices, mounts)")
    for b in ("nearstore", "nearstore-lab"):
        if not os.access(os.path.join(a.bin, b), os.X_OK):
            sys.exit(f"no {b} in {a.bin}: cargo build --release first")
    os.makedirs(a.out, exist_ok=True)
    lab = Lab(a)
    t = time.time()
    try:
        lab.up()
        if not a.no_sweep:
            records = lab.sweep()
            with open(os.path.join(a.out, "volume.json"), "w") as f:
                json.dump(records, f, indent=1)
        if not a.no_rebalance:
            with open(os.path.join(a.out, "volume-rebalance.json"), "w") as f:
                json.dump([lab.rebalance()], f, indent=1)
    finally:
        lab.down()
    print(f"done in {time.time() - t:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

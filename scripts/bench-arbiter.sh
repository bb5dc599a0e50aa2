#!/usr/bin/env bash
# The control plane's arbiter (issue 16; docs/fair-io.md, "The arbiter"; docs/benchmarks.md):
# one build, in one run, with the arbiter off and on. A control plane; target A with one pool
# (a rate device of 32 MiB/s under it, its fair bandwidth declared as 28 MiB/s); target B with
# no pool. Tenant heavy (io_weight 300) reads volume vh, exported by B; tenant light
# (io_weight 100) reads volume vl, exported by A; both volumes lie in A's pool, so B's reads
# reach it as the peers' one tenant `cluster`. Each round starts everything afresh per side
# (off, on; the order alternating from round to round), writes both volumes whole, then runs
# both tenants' 64 KiB random reads at QD 16 at once for SECONDS; heavy's share of what the
# pool moved is the figure (wanted: 0.75 with the arbiter; the pool's own scheduler gives
# 0.5). Then medians per side. Each "on" run checks on B's metrics endpoint that the arbiter
# answered and its gate held heavy back, each "off" run that no request was sent.
# Usage: scripts/bench-arbiter.sh BIN [rounds] [seconds]   (default 5 rounds, 5 s)
# Example: flock /work/cargo.lock scripts/bench-arbiter.sh target/release/nearstore 5
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,14p' "$0"; exit 2; }
bin=$(realpath "$1") rounds=${2:-5} secs=${3:-5}
[ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }
work=$(mktemp -d)
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop; rm -rf "$work"' EXIT
cport=44300 aport=44301 bport=44302 amet=44303 bmet=44304
heavy=nqn.2014-08.org.nvmexpress:uuid:bench-arbiter-heavy
light=nqn.2014-08.org.nvmexpress:uuid:bench-arbiter-light
m1=nqn.2026-11.io.nearstore:bench-member1 m2=nqn.2026-11.io.nearstore:bench-member2
ctl=127.0.0.1:$cport

target_config() { # index side -> configuration of target A (0) or B (1)
    local i=$1 side=$2 port member met pool=
    if [ "$i" = 0 ]; then port=$aport member=$m1 met=$amet; else port=$bport member=$m2 met=$bmet; fi
    [ "$i" = 0 ] && pool=$(printf '[[pool]]\npath = "%s/p0"\nsize = "64MiB"\nrate_limit = "32MiB"\nfair = { bandwidth = "28MiB" }\n' "$work")
    cat <<EOF
control = "$ctl"
metrics = "127.0.0.1:$met"
[[listener]]
address = "127.0.0.1:$port"
[cluster]
host_nqn = "$member"
trusted_members = ["$m1", "$m2"]
[volume]
arbiter = $([ "$side" = on ] && echo true || echo false)
$pool
EOF
}

metric() { # port name -> value
    python3 - "$1" "$2" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
print(sum(int(float(l.split()[-1])) for l in text.splitlines() if l.split() and l.split()[0] == sys.argv[2]))
PY
}

perf() { # port volume host workload seconds -> JSON
    "$bin" perf -a "127.0.0.1:$1" -n "nqn.2026-11.io.nearstore:volume:$2" --hostnqn "$3" \
        -w "$4" -z 64KiB -q 16 -T "$5" -o json
}

run() { # side -> heavy's MB/s, light's MB/s
    local side=$1
    rm -rf "$work/store" "$work/p0"
    "$bin" control --listen "$ctl" --store "$work/store" > "$work/control.out" 2>&1 &
    pids+=($!)
    for i in 0 1; do
        target_config $i "$side" > "$work/t$i.toml"
        "$bin" target --config "$work/t$i.toml" --discovery none > "$work/t$i.out" 2>&1 &
        pids+=($!)
    done
    local deadline=$((SECONDS + 20))
    until [ "$("$bin" view --control "$ctl" -o json 2>/dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["targets"]))' 2>/dev/null || echo 0)" = 2 ]; do
        [ $SECONDS -lt $deadline ] || { echo "the targets did not register" >&2; cat "$work"/t*.out >&2; exit 1; }
        sleep 0.2
    done
    "$bin" tenant create heavy --host "$heavy" --io-weight 300 --reach volume:vh --control "$ctl" > /dev/null
    "$bin" tenant create light --host "$light" --io-weight 100 --reach volume:vl --control "$ctl" > /dev/null
    for v in vh vl; do "$bin" volume create $v --size 4MiB --extent-size 1MiB --control "$ctl" > /dev/null; done
    "$bin" volume export vh --target "127.0.0.1:$bport" --allow-host "$heavy" --control "$ctl" > /dev/null
    "$bin" volume export vl --target "127.0.0.1:$aport" --allow-host "$light" --control "$ctl" > /dev/null
    # Written whole (a read of an unwritten extent never reaches the pool).
    for spec in "$bport vh $heavy" "$aport vl $light"; do
        set -- $spec
        deadline=$((SECONDS + 20))
        until perf "$1" "$2" "$3" write 1 > /dev/null 2>&1; do
            [ $SECONDS -lt $deadline ] || { echo "$2 was not exported" >&2; exit 1; }
            sleep 0.2
        done
    done
    perf $bport vh "$heavy" randread "$secs" > "$work/heavy.json" &
    local hp=$!
    perf $aport vl "$light" randread "$secs" > "$work/light.json"
    wait $hp
    local requests held
    requests=$(metric $bmet nearstore_arbiter_requests_total)
    held=$(metric $bmet nearstore_arbiter_held_total)
    if [ "$side" = on ] && { [ "$requests" = 0 ] || [ "$held" = 0 ]; }; then
        echo "on: the arbiter did not work ($requests requests, $held held)" >&2; exit 1
    fi
    if [ "$side" = off ] && [ "$requests" != 0 ]; then
        echo "off: $requests requests sent" >&2; exit 1
    fi
    stop
    python3 - "$work/heavy.json" "$work/light.json" <<'PY'
import json, sys
h, l = (json.load(open(p))["mb_per_s"] for p in sys.argv[1:3])
print(f"{h:.1f} {l:.1f}")
PY
}

echo "# $(date -u +%FT%TZ) $(uname -m) $(nproc) cores; $bin; $rounds rounds of $secs s"
echo "round side heavy_MBps light_MBps heavy_share"
results=()
for r in $(seq 1 "$rounds"); do
    if [ $((r % 2)) = 1 ]; then order="off on"; else order="on off"; fi
    for side in $order; do
        read -r h l < <(run "$side")
        share=$(python3 -c "print(f'{$h/($h+$l):.3f}')")
        echo "$r $side $h $l $share"
        results+=("$side $share $h $l")
    done
done
printf '%s\n' "${results[@]}" | python3 -c '
import sys, statistics
rows = [l.split() for l in sys.stdin if l.strip()]
for side in ("off", "on"):
    s = [float(r[1]) for r in rows if r[0] == side]
    t = [float(r[2]) + float(r[3]) for r in rows if r[0] == side]
    print(f"median {side}: heavy share {statistics.median(s):.3f} (of {len(s)} runs), pool {statistics.median(t):.1f} MB/s")
'

#!/usr/bin/env python3
"""Statistics for tests/bench/step_time.sh (Python 3 standard library only).

Reads RESULTS/runs.tsv, one line per `interlock train` run:

    config <TAB> mode <TAB> round <TAB> run folder <TAB> cpu stall us <TAB> wall us
        [<TAB> "minor-page-faults user-s system-s" of the whole process]

and each run folder's metrics.jsonl, and prints Markdown tables of step time.

Step time. Step s's line holds in wall_seconds the moment step s had finished
everywhere (seconds of training since the start), so difference i of
wall_seconds is the time of step i+1; step 0 and start-up are in the first
line alone. (The line itself is written once the virtual clock has placed the
step, up to two steps later; the value is not affected.) Steps below --warmup are dropped; the
rest, over all rounds of a (config, mode), are pooled and their median
reported. (Binaries before commit a2e8631 wrote each line a step late in the
sequential schedule; their numbers need the older version of this script.)

CPU stall: the growth of the "some" total of /proc/pressure/cpu during the run
divided by the run's wall time: the share of time some task on the machine
waited for a core. It shows how much the other users of the 2 cores disturbed a
run (0 when the kernel has no PSI).

Page faults and system time (from /usr/bin/time, whole process including
start-up and evaluation) show how much of a run went to the kernel handing
memory back and forth.
"""
import argparse
import json
import os
import statistics
import sys

MODE_LABELS = {
    "e2e": "E2E",
    "1": "1-way",
    "2": "2-way furthest",
    "2sum": "2-way sum",
    "3": "3-way furthest",
    "3sum": "3-way sum",
    "4": "4-way furthest",
    "4sum": "4-way sum",
}


def percentile(values, q):
    """Linear-interpolated percentile, q in [0, 100]."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def step_times(metrics_path, warmup, clock="wall_seconds"):
    walls = []
    with open(metrics_path) as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                walls.append((rec["step"], rec[clock]))
    walls.sort()
    diffs = [b[1] - a[1] for a, b in zip(walls, walls[1:])]
    # diffs[i] is the time of step i+1 (see the module comment): keep steps
    # warmup, warmup+1, ...
    return diffs[max(0, warmup - 1):]


def batch_size(run_dir):
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return int(json.load(f)["batch_size"])
    except (OSError, ValueError, KeyError):
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="folder with runs.tsv")
    ap.add_argument("--warmup", type=int, default=5,
                    help="leading step times to drop per run")
    args = ap.parse_args()

    runs = {}  # (config, mode) -> list of (round, times, stall share)
    order = []
    with open(os.path.join(args.results, "runs.tsv")) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 6:
                continue
            config, mode, rnd, run_dir, stall_us, wall_us = parts[:6]
            usage = parts[6].split() if len(parts) > 6 else []
            faults = sys_share = None
            if len(usage) == 3:
                faults = float(usage[0])
                cpu = float(usage[1]) + float(usage[2])
                sys_share = float(usage[2]) / cpu if cpu > 0 else 0.0
            key = (config, mode)
            if key not in runs:
                runs[key] = []
                order.append(key)
            times = step_times(os.path.join(run_dir, "metrics.jsonl"),
                               args.warmup)
            stall = (float(stall_us) / float(wall_us)
                     if float(wall_us) > 0 and stall_us != "" else 0.0)
            runs[key].append((int(rnd), times, stall,
                              batch_size(run_dir), faults, sys_share))

    if not runs:
        print("no runs recorded", file=sys.stderr)
        return 1

    # Group by config, keeping the order in which configs first appear.
    configs = []
    for c, _ in order:
        if c not in configs:
            configs.append(c)

    medians = {}
    print("| config | mode | median s/step | p10 s/step | samples/s | "
          "ratio vs E2E | per-round medians (s) | steps timed | CPU stall | "
          "page faults/run | system time |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for c in configs:
        keys = [k for k in order if k[0] == c]
        for key in keys:
            pooled = [t for _, ts, *_ in runs[key] for t in ts]
            medians[key] = statistics.median(pooled) if pooled else float("nan")
        e2e = medians.get((c, "e2e"))
        for key in keys:
            rows = runs[key]
            pooled = [t for _, ts, *_ in rows for t in ts]
            med = medians[key]
            batch = max(r[3] for r in rows)
            sps = batch / med if med > 0 and batch > 0 else float("nan")
            ratio = f"{med / e2e:.2f}" if e2e else "n/a"
            per_round = "/".join(
                f"{statistics.median(ts):.3f}" for _, ts, *_ in
                sorted(rows) if ts)
            stall = statistics.mean(r[2] for r in rows)
            faults = [r[4] for r in rows if r[4] is not None]
            shares = [r[5] for r in rows if r[5] is not None]
            fault_txt = (f"{statistics.mean(faults) / 1000:.0f}k"
                         if faults else "n/a")
            share_txt = (f"{100 * statistics.mean(shares):.0f}%"
                         if shares else "n/a")
            print(f"| {c} | {MODE_LABELS.get(key[1], key[1])} | {med:.3f} | "
                  f"{percentile(pooled, 10):.3f} | {sps:.0f} | {ratio} | "
                  f"{per_round} | {len(pooled)} | {100 * stall:.0f}% | "
                  f"{fault_txt} | {share_txt} |")

    # What the n-way entries add over 1-way: input-gradient-only passes
    # (see docs/BENCHMARKS.md for the count per mode).
    print()
    print("| config | 2-way - 1-way (s) | 2sum - 1-way (s) | "
          "3-way - 2-way (s) | 4-way - 3-way (s) | 1-way - E2E (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for c in configs:
        def m(mode):
            return medians.get((c, mode))

        def d(a, b):
            return (f"{m(a) - m(b):+.3f}" if m(a) is not None
                    and m(b) is not None else "n/a")
        print(f"| {c} | {d('2', '1')} | {d('2sum', '1')} | {d('3', '2')} | "
              f"{d('4', '3')} | {d('1', 'e2e')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Statistics for tests/bench/side_by_side.sh (Python 3 standard library only).

Reads RESULTS/runs.tsv, one line per run:

    implementation (python|interlock) <TAB> mode <TAB> round <TAB> steps
        <TAB> run folder <TAB> cpu stall us <TAB> wall us

and each run folder's metrics.jsonl (the same format from both). Every
(implementation, mode, round) has a short and a long run; its time per step is

    (wall_seconds of the long run's last step
     - wall_seconds of the short run's last step) / (long steps - short steps)

Start-up, the warm-up steps and the drain after the last step are in both
runs and cancel. The median over rounds is reported with the range, and the
ratio Interlock / Python of the medians. RESULTS/medians.tsv gets (mode,
Python s/step, Interlock s/step) for roofline.py.

Why not the per-step differences of wall_seconds that step_time_stats.py
uses: a step's wall_seconds is when its completion reached the coordinator.
In Interlock's 1-way threaded runs block 0 runs ahead and handles the
completions coming up from block 1 only after the forwards already in its
inbox, so they arrive in bursts (many differences near 0, some of several
steps). The table still shows how many of each run's differences are under
1 ms, as a warning sign.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time_stats import MODE_LABELS  # noqa: E402

IMPLS = ("python", "interlock")


def read_metrics(run_dir):
    """[(step, wall_seconds, model's loss)] in step order."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                rows.append((rec["step"], rec["wall_seconds"],
                             rec["loss"][-1]))
    return sorted(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="folder with runs.tsv")
    args = ap.parse_args()

    # (impl, mode, round) -> {steps: (metrics rows, stall share)}
    runs, modes = {}, []
    with open(os.path.join(args.results, "runs.tsv")) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 7:
                continue
            impl, mode, rnd, steps, run_dir, stall_us, wall_us = parts[:7]
            stall = (float(stall_us) / float(wall_us)
                     if stall_us and float(wall_us) > 0 else 0.0)
            runs.setdefault((impl, mode, int(rnd)), {})[int(steps)] = (
                read_metrics(run_dir), stall)
            if mode not in modes:
                modes.append(mode)
    if not runs:
        print("no runs recorded", file=sys.stderr)
        return 1

    per_step = {}  # (impl, mode) -> [s/step per round]
    stalls, bursts, losses = {}, {}, {}
    for (impl, mode, rnd), by_steps in sorted(runs.items()):
        if len(by_steps) != 2:
            continue
        (short, (rows_s, stall_s)), (long_, (rows_l, stall_l)) = \
            sorted(by_steps.items())
        t = (rows_l[-1][1] - rows_s[-1][1]) / (long_ - short)
        per_step.setdefault((impl, mode), []).append(t)
        stalls.setdefault((impl, mode), []).extend([stall_s, stall_l])
        diffs = [b[1] - a[1] for a, b in zip(rows_l, rows_l[1:])]
        b = bursts.setdefault((impl, mode), [0, 0])
        b[0] += sum(d < 1e-3 for d in diffs)
        b[1] += len(diffs)
        losses.setdefault((impl, mode), []).extend(
            r[0][2] for r, _ in (by_steps[short], by_steps[long_])
            if r and r[0][0] == 0 and r[0][2] is not None)

    def cell(impl, mode):
        ts = per_step.get((impl, mode), [])
        if not ts:
            return "n/a", None
        med = statistics.median(ts)
        return "%.3f (%.3f–%.3f)" % (med, min(ts), max(ts)), med

    def stall(impl, mode):
        v = stalls.get((impl, mode))
        return "%.0f %%" % (100 * statistics.mean(v)) if v else "n/a"

    def burst(impl, mode):
        n, total = bursts.get((impl, mode), (0, 0))
        return "%d/%d" % (n, total)

    rounds = max(len(v) for v in per_step.values()) if per_step else 0
    print("s/step: median over %d round(s) (min–max)." % rounds)
    print()
    print("| mode | Python s/step | Interlock s/step | "
          "ratio Interlock / Python | CPU stall Python / Interlock | "
          "wall_seconds steps < 1 ms apart, Python / Interlock |")
    print("|---|---:|---:|---:|---:|---:|")
    medians = []
    for mode in modes:
        py_txt, py = cell("python", mode)
        il_txt, il = cell("interlock", mode)
        ratio = "%.2f" % (il / py) if py and il else "n/a"
        print("| %s | %s | %s | %s | %s / %s | %s / %s |" % (
            MODE_LABELS.get(mode, mode), py_txt, il_txt, ratio,
            stall("python", mode), stall("interlock", mode),
            burst("python", mode), burst("interlock", mode)))
        medians.append((mode, py or 0.0, il or 0.0))
    with open(os.path.join(args.results, "medians.tsv"), "w") as f:
        for mode, py, il in medians:
            f.write("%s\t%.6f\t%.6f\n" % (mode, py, il))

    # Not a timing: a check that both train the same kind of model on the
    # same kind of data (values differ: other random streams).
    print()
    print("Model's loss at step 0, mean over runs (other initial values and "
          "data in each implementation: close, not equal):")
    print()
    print("| mode | Python | Interlock |")
    print("|---|---:|---:|")
    for mode in modes:
        vals = []
        for impl in IMPLS:
            ls = losses.get((impl, mode), [])
            vals.append("%.3f" % statistics.mean(ls) if ls else "n/a")
        print("| %s | %s | %s |" % (MODE_LABELS.get(mode, mode), *vals))
    return 0


if __name__ == "__main__":
    sys.exit(main())

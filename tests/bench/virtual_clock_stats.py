#!/usr/bin/env python3
"""Tables for tests/bench/virtual_clock.sh (Python 3 standard library only).

Reads RESULTS/runs.tsv (part, M or config, mode, engine, round, run folder),
each run's metrics.jsonl and the simulate.txt beside it. A run's step time
is the mean of the differences of `wall_seconds` (or `virtual_seconds`)
between consecutive steps after the warm-up steps (step_time_stats
.step_times), i.e. the slope over the counted steps; a mode's is the median
over rounds. Not the median of the differences: where blocks run ahead (1-way
on a cluster) steps complete in bursts of two or three, and half the
differences are then near zero.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time_stats import MODE_LABELS, step_times  # noqa: E402


# The modes the K = 4 part predicts, in table order.
MODE_ORDER = ["e2e", "1", "2", "2sum", "3", "3sum"]


def median(values):
    return statistics.median(values) if values else float("nan")


def mean_step(metrics_path, warmup, clock="wall_seconds"):
    times = step_times(metrics_path, warmup, clock)
    return [statistics.fmean(times)] if times else []


def simulated(run_dir, mode):
    """Step time `interlock simulate` printed for this mode, if any."""
    if mode == "e2e":
        labels = ["e2e"]
    elif mode.endswith("sum"):
        # simulate prints no SUM row where SUM runs the passes FURTHEST
        # runs (2-way at K = 4, say): the FURTHEST row stands for it.
        labels = [mode[:-3] + "-way sum", mode[:-3] + "-way furthest"]
    else:
        labels = [mode + "-way furthest"]
    try:
        with open(os.path.join(run_dir, "simulate.txt")) as f:
            lines = [line.lstrip("* ").rstrip() for line in f]
    except OSError:
        return float("nan")
    for label in labels:
        for text in lines:
            if text.startswith(label + " "):
                try:
                    return float(text[len(label):].split()[0])
                except (ValueError, IndexError):
                    return float("nan")
    return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--fid-warmup", type=int, default=8)
    ap.add_argument("--k4-warmup", type=int, default=None,
                    help="default: 4 for the Transformer, else 5")
    args = ap.parse_args()
    fid = {}   # (M, mode) -> {"wall": [], "virtual": [], "sim": []}
    k4 = {}  # config -> {mode: {"virtual": [], "sim": {mode: []}}}
    order = []
    with open(os.path.join(args.results, "runs.tsv")) as f:
        for line in f:
            part, m, mode, engine, _, run = line.rstrip("\n").split("\t")
            path = os.path.join(run, "metrics.jsonl")
            if part == "fidelity":
                key = (int(m), mode)
                if key not in fid:
                    fid[key] = {"wall": [], "virtual": [], "sim": []}
                    order.append(key)
                if engine == "cluster":
                    fid[key]["wall"] += mean_step(path, args.fid_warmup)
                    fid[key]["virtual"] += mean_step(
                        path, args.fid_warmup, "virtual_seconds")
                else:
                    fid[key]["sim"].append(simulated(run, mode))
            else:
                warmup = args.k4_warmup
                if warmup is None:
                    warmup = 4 if "transformer" in m else 5
                d = k4.setdefault(m, {}).setdefault(
                    mode, {"virtual": [], "sim": {}})
                d["virtual"] += mean_step(path, warmup, "virtual_seconds")
                for target in MODE_ORDER:
                    d["sim"].setdefault(target, []).append(
                        simulated(run, target))
    if fid:
        print("### Fidelity, K = 2 (two workers, one thread each)\n")
        print("| M | mode | measured wall s/step | run's virtual clock | "
              "ratio | simulate (in-process profile) | ratio |")
        print("|---|---|---|---|---|---|---|")
        for key in order:
            d = fid[key]
            w, v, s = median(d["wall"]), median(d["virtual"]), median(d["sim"])
            print(f"| {key[0]} | {MODE_LABELS.get(key[1], key[1])} | {w:.4f} "
                  f"| {v:.4f} | {v / w:.3f} | {s:.4f} | {s / w:.3f} |")
        print()
    for config, runs in k4.items():
        modes = [m for m in MODE_ORDER if m in runs]
        measured = {m: median(runs[m]["virtual"]) for m in modes}
        print(f"### Fidelity, K = 4, {config} (virtual clock)\n")
        print("Rows: the run whose profile simulate read; columns: the mode "
              "predicted, as predicted / the virtual s/step that mode's own "
              "run measured.\n")
        labels = [MODE_LABELS.get(m, m) for m in modes]
        print("| profile | " + " | ".join(labels) + " |")
        print("|---|" + "---:|" * len(modes))
        print("| measured s/step | " +
              " | ".join(f"{measured[m]:.4f}" for m in modes) + " |")
        for src in modes:
            cells = []
            for m in modes:
                pred = median([x for x in runs[src]["sim"].get(m, [])
                               if x == x])
                cells.append(f"{pred / measured[m]:.3f}")
            print(f"| {MODE_LABELS.get(src, src)} | " + " | ".join(cells) +
                  " |")
        print()


if __name__ == "__main__":
    main()

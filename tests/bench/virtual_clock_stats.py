#!/usr/bin/env python3
"""Tables for tests/bench/virtual_clock.sh (Python 3 standard library only).

Reads RESULTS/runs.tsv (part, M, mode, engine, round, run folder) and each
run's metrics.jsonl. Step times are medians of the differences of
`wall_seconds` (or `virtual_seconds`) between consecutive steps, after the
warm-up steps, pooled over rounds (step_time_stats.step_times).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time_stats import MODE_LABELS, step_times  # noqa: E402


def median(values):
    return statistics.median(values) if values else float("nan")


def simulated(run_dir, mode):
    """Step time `interlock simulate` printed for this mode, if any."""
    if mode == "e2e":
        label = "e2e"
    elif mode.endswith("sum"):
        label = mode[:-3] + "-way sum"
    else:
        label = mode + "-way furthest"
    try:
        with open(os.path.join(run_dir, "simulate.txt")) as f:
            for line in f:
                text = line.lstrip("* ").rstrip()
                if text.startswith(label + " "):
                    return float(text[len(label):].split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--fid-warmup", type=int, default=5)
    ap.add_argument("--head-warmup", type=int, default=4)
    args = ap.parse_args()
    fid = {}   # (M, mode) -> {"wall": [], "virtual": [], "sim": []}
    head = {}  # mode -> virtual step times
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
                    fid[key]["wall"] += step_times(path, args.fid_warmup)
                    fid[key]["virtual"] += step_times(
                        path, args.fid_warmup, "virtual_seconds")
                else:
                    fid[key]["sim"].append(simulated(run, mode))
            else:
                head.setdefault(mode, []).extend(
                    step_times(path, args.head_warmup, "virtual_seconds"))
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
    if head:
        print("### Headline, K = 4 Transformer, virtual clock\n")
        print("| mode | virtual s/step | / E2E |")
        print("|---|---|---|")
        e2e = median(head.get("e2e", []))
        for mode, times in head.items():
            v = median(times)
            print(f"| {MODE_LABELS.get(mode, mode)} | {v:.4f} | {v / e2e:.3f} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The paper's two claims, read from an `interlock compare --seeds` folder.

Python 3 standard library only. Reads every run folder under RESULTS that
holds a summary.json and an eval.jsonl (`e2e-seed1/`, `2sum-seed3/`, ...) and
prints a Markdown section:

* per mode: finished runs, steps, virtual step time and its ratio to E2E's,
  and the final head's test metric at the budget (mean ± sample sd);
* the target: E2E's mean final metric at the budget; per run, the virtual
  time of the first evaluation at which the final head reaches it (accuracy
  at least, perplexity at most the target) and, between that evaluation and
  the one before, the linearly interpolated crossing;
* the verdict on (a) interlocked modes reach E2E's final quality sooner on
  the virtual clock than E2E itself does, and (b) 2-way's virtual step is at
  most half of E2E's (and 1-way's at most 0.3, the issue's target).
"""
import argparse
import json
import math
import os
import re
import statistics
import sys


def number(v):
    if isinstance(v, str):
        return float(v)  # "NaN", "Infinity"
    return float(v)


def mean_sd(values):
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return float("nan"), float("nan"), 0
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return statistics.fmean(values), sd, len(values)


def fmt(m, decimals, unit=""):
    mean, sd, n = m
    if n == 0:
        return "-"
    s = "-" if n < 2 else f"{sd:.{decimals}f}"
    return f"{mean:.{decimals}f}{unit} ± {s}"


def load_run(path):
    with open(os.path.join(path, "summary.json")) as f:
        summary = json.load(f)
    evals = []
    with open(os.path.join(path, "eval.jsonl")) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            e = json.loads(line)
            if e.get("head") != "final":
                continue
            evals.append(e)
    evals.sort(key=lambda e: number(e.get("step", 0)))
    return summary, evals


def metric_of(e, text):
    return number(e["perplexity"]) if text else 100.0 * number(e["accuracy"])


def mode_key(folder):
    """("2sum", 3) from "2sum-seed3"; the mode's folder name and the seed."""
    m = re.fullmatch(r"(.+)-seed(\d+)", folder)
    return (m.group(1), int(m.group(2))) if m else (folder, None)


def reached(evals, target, text):
    """First evaluation reaching `target`: (its virtual time, the
    interpolated crossing, its step) or None."""
    better = (lambda v: v <= target) if text else (lambda v: v >= target)
    prev = None
    for e in evals:
        v, t = metric_of(e, text), number(e["virtual_seconds"])
        if math.isfinite(v) and better(v):
            cross = t
            if prev is not None and prev[0] != v:
                pv, pt = prev
                cross = pt + (target - pv) / (v - pv) * (t - pt)
            return t, cross, int(number(e["step"]))
        if math.isfinite(v):
            prev = (v, t)
    return None


LABELS = {"e2e": "E2E"}


def label(mode):
    if mode in LABELS:
        return LABELS[mode]
    m = re.fullmatch(r"(\d+)(way|sum)", mode)
    if not m:
        return mode
    return f"{m.group(1)}-way " + ("sum" if m.group(2) == "sum" else "furthest")


def ways(mode):
    m = re.fullmatch(r"(\d+)(way|sum)", mode)
    return int(m.group(1)) if m else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    args = ap.parse_args()
    runs = {}  # mode folder -> [(seed, summary, evals)]
    order = []
    for name in sorted(os.listdir(args.results)):
        path = os.path.join(args.results, name)
        if not (os.path.isfile(os.path.join(path, "summary.json"))
                and os.path.isfile(os.path.join(path, "eval.jsonl"))):
            continue
        mode, seed = mode_key(name)
        try:
            summary, evals = load_run(path)
        except (OSError, ValueError, KeyError) as err:
            print(f"skipping {name}: {err}", file=sys.stderr)
            continue
        if mode not in runs:
            runs[mode] = []
            order.append(mode)
        runs[mode].append((seed, summary, evals))
    if "e2e" not in runs:
        sys.exit("no finished E2E run under " + args.results)
    order.sort(key=lambda m: (m != "e2e", ways(m) or 0, m))
    text = any(math.isfinite(metric_of(e, True))
               for _, _, ev in runs["e2e"] for e in ev if "perplexity" in e)
    what = "perplexity" if text else "accuracy"
    unit = "" if text else "%"
    dec = 3 if text else 2

    def final(evals):
        return metric_of(evals[-1], text) if evals else float("nan")

    def step_virtual(summary):
        return number(summary.get("mean_step_seconds", {}).get("virtual",
                                                               "NaN"))

    e2e_step = mean_sd([step_virtual(s) for _, s, _ in runs["e2e"]])[0]
    target = mean_sd([final(ev) for _, _, ev in runs["e2e"]])[0]

    print("### Per mode at the budget\n")
    print(f"| mode | runs | steps | virtual s/step | / E2E | "
          f"final test {what} |")
    print("|---|---:|---:|---:|---:|---:|")
    ratio = {}
    for mode in order:
        rs = runs[mode]
        sv = mean_sd([step_virtual(s) for _, s, _ in rs])
        ratio[mode] = sv[0] / e2e_step
        print(f"| {label(mode)} | {len(rs)} "
              f"| {fmt(mean_sd([number(s['steps']) for _, s, _ in rs]), 1)} "
              f"| {fmt(sv, 4)} | {ratio[mode]:.3f} "
              f"| {fmt(mean_sd([final(ev) for _, _, ev in rs]), dec, unit)} |")

    print(f"\n### Virtual time to E2E's final {what} "
          f"({target:.{dec}f}{unit}, the mean of E2E's runs at the budget)\n")
    print("First evaluation of the final head at or beyond the target: its "
          "virtual time and, in brackets, the crossing interpolated from the "
          "evaluation before it; \"no\" where the run never reached it.\n")
    print("| mode | " + " | ".join(
        (f"seed {s}" if s is not None else "run") for s, _, _ in runs["e2e"]) + " | mean (reaching runs) |")
    print("|---|" + "---:|" * (len(runs["e2e"]) + 1))
    seeds = [s for s, _, _ in runs["e2e"]]
    times = {}
    for mode in order:
        by_seed = {s: ev for s, _, ev in runs[mode]}
        cells, hit = [], []
        for s in seeds:
            r = reached(by_seed[s], target, text) if s in by_seed else None
            if s not in by_seed:
                cells.append("not run")
            elif r is None:
                cells.append("no")
            else:
                cells.append(f"{r[0]:.1f} s ({r[1]:.1f} s)")
                hit.append(r[1])
        times[mode] = (hit, len(by_seed))
        m = f"{statistics.fmean(hit):.1f} s ({len(hit)}/{len(by_seed)})" \
            if hit else f"- (0/{len(by_seed)})"
        print(f"| {label(mode)} | " + " | ".join(cells) + f" | {m} |")

    print("\n### The claims\n")
    e2e_hit, e2e_n = times["e2e"]
    e2e_t = statistics.fmean(e2e_hit) if e2e_hit else float("inf")
    for mode in order:
        if mode == "e2e":
            continue
        hit, n = times[mode]
        if len(hit) == n and n > 0 and statistics.fmean(hit) < e2e_t:
            verdict = (f"**holds**: every run reached it, after "
                       f"{statistics.fmean(hit):.1f} s on average against "
                       f"E2E's {e2e_t:.1f} s")
        elif hit:
            verdict = (f"**does not hold** as stated: {len(hit)} of {n} runs "
                       f"reached it (mean {statistics.fmean(hit):.1f} s, E2E "
                       f"{e2e_t:.1f} s)")
        else:
            verdict = f"**does not hold**: none of its {n} runs reached it"
        print(f"* (a) {label(mode)} reaches E2E's final {what} sooner: "
              f"{verdict}.")
    for mode in order:
        w = ways(mode)
        if w == 2:
            ok = ratio[mode] <= 0.5
            print(f"* (b) {label(mode)} virtual step / E2E's = "
                  f"{ratio[mode]:.3f}: "
                  f"{'**holds** (≤ 0.5)' if ok else '**does not hold** (> 0.5)'}.")
        elif w == 1:
            ok = ratio[mode] <= 0.3
            print(f"* (issue target) 1-way virtual step / E2E's = "
                  f"{ratio[mode]:.3f}: "
                  f"{'met (≤ 0.3)' if ok else 'not met (> 0.3)'}.")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Resident-memory growth per process from soak.sh's samples.

Usage: soak_stats.py RSS_TSV WARMUP_FRACTION WARN_PCT

For every process, the samples after the warm-up fraction are split into a
first and a last tenth; growth is the median of the last tenth over the
median of the first, in percent. Prints a Markdown table; exits 1 when any
process grew by WARN_PCT percent or more.
"""
import statistics
import sys
from collections import defaultdict


def main() -> int:
    path, warmup, warn = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    samples = defaultdict(list)
    roles = {}
    with open(path) as f:
        next(f)
        for line in f:
            t, pid, role, rss = line.split("\t")
            samples[pid].append((float(t), int(rss)))
            roles[pid] = role
    print("| process | samples | RSS after warm-up (MiB) | RSS at end (MiB) "
          "| growth |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for pid, s in sorted(samples.items(), key=lambda kv: (roles[kv[0]], kv[0])):
        s.sort()
        kept = s[int(len(s) * warmup):]
        if len(kept) < 10:
            print(f"| {roles[pid]} {pid} | {len(s)} | too few samples | | |")
            continue
        tenth = max(1, len(kept) // 10)
        first = statistics.median(r for _, r in kept[:tenth])
        last = statistics.median(r for _, r in kept[-tenth:])
        growth = 100.0 * (last - first) / first
        worst = max(worst, growth)
        print(f"| {roles[pid]} {pid} | {len(s)} | {first / 1024:.1f} "
              f"| {last / 1024:.1f} | {growth:+.2f}% |")
    print(f"\nlargest growth {worst:+.2f}% (limit {warn:.0f}%)")
    return 1 if worst >= warn else 0


if __name__ == "__main__":
    sys.exit(main())

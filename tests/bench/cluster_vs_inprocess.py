#!/usr/bin/env python3
"""Cluster versus in-process step time (Python 3 standard library only).

Driven by tests/bench/cluster_vs_inprocess.sh (results in docs/BENCHMARKS.md).
For every round, every config (NAME=PATH) and every mode it runs

    interlock train --config PATH <mode flags> --engine E --threads-per-block 1
        --schedule sequential --quiet --steps N --out DIR

once with each engine, back to back, the engine order alternating and the
(config, mode) order rotating from round to round, so that noise from other
users of the machine falls on both engines alike. `--engine cluster` makes the
CLI start one `interlock-worker` per block on loopback and stop them at the
end.

While a run goes, the CPU time (user + system, /proc/PID/stat) of the CLI and
of each of its child processes (the workers) is sampled every --poll seconds
together with the number of lines in metrics.jsonl, so the CPU each process
used during the timed steps can be told apart from start-up and evaluation.

Step time: wall_seconds in metrics.jsonl is written as soon as each step has
finished, so difference i is step i+1. Steps below --warmup are dropped. With
the cluster, completions reach the coordinator in bunches (in 1-way two steps
often finish within a few ms of each other, then nothing for two step times),
so single differences are not step times there; the main figure is therefore
the mean over a run's timed steps, (wall[N-1] - wall[warmup-1]) / (N - warmup),
and the table gives the median of that over the rounds (with every round's
value, to show the spread), samples/s = batch size / that. The median and 10th
percentile of the single differences, pooled over the rounds, are listed too.

CPU columns ("cores"): CPU seconds / wall seconds of each process between the
first sample at which step warmup-1 was recorded and the last sample before
the final step was recorded, averaged over the rounds. 1.00 = one core busy.
Page faults/step: minor page faults of each process in the same window, per
step; a process that keeps handing memory back to the kernel and faulting it in
again shows tens of thousands here (see docs/BENCHMARKS.md).
CPU stall: share of the run's wall time in which some task on the machine
waited for a core (Linux PSI "some"), a measure of how busy the machine was.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Shared with the in-process benchmark: same step-time and percentile rules.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time_stats import MODE_LABELS, percentile, step_times  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def mode_flags(mode):
    """e2e, N (N-way, FURTHEST rule) or Nsum (N-way, SUM rule)."""
    if mode == "e2e":
        return ["--mode", "e2e"]
    rule = "sum" if mode.endswith("sum") else "furthest"
    n = mode[:-3] if rule == "sum" else mode
    if not n.isdigit():
        raise ValueError(f"mode {mode!r}: expected e2e, N or Nsum")
    return ["--mode", "interlock", "--n", n, "--rule", rule]


def proc_cpu(pid):
    """(start time, utime + stime in ticks, minor page faults) of pid, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return None
    fields = s[s.rfind(")") + 2:].split()
    # fields[0] is field 3 (state): minflt = field 10, utime = 14,
    # stime = 15, start = 22.
    return int(fields[19]), int(fields[11]) + int(fields[12]), int(fields[7])


def children(pid):
    out = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out.update(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def cpu_stall_us():
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.split("total=")[1])
    except OSError:
        pass
    return None


def count_lines(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def run_one(cmd, run_dir, poll, env):
    """Runs cmd, sampling CPU; returns (samples, wall s, stall us, rc).

    samples: list of (t, lines in metrics.jsonl, {pid: (start, ticks)}, cli).
    """
    os.makedirs(run_dir, exist_ok=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    samples = []
    stall0 = cpu_stall_us()
    t0 = time.monotonic()
    with open(run_dir + ".log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                             env=env)
        while True:
            rc = p.poll()
            pids = {p.pid} | children(p.pid)
            cpu = {}
            for pid in pids:
                v = proc_cpu(pid)
                if v is not None:
                    cpu[pid] = v
            samples.append((time.monotonic() - t0, count_lines(metrics), cpu))
            if rc is not None:
                break
            time.sleep(poll)
    wall = time.monotonic() - t0
    stall1 = cpu_stall_us()
    stall = stall1 - stall0 if stall0 is not None and stall1 is not None else 0
    return samples, wall, stall, p.pid, rc


def window_cores(samples, cli_pid, warmup, steps):
    """Per process [coordinator, worker 0, worker 1, ...] in the timed window:
    (cores used, minor page faults per second).

    Window: first sample with >= warmup lines (step warmup-1 recorded) to the
    last sample with < steps lines (before the final step was recorded).
    """
    a = next((s for s in samples if s[1] >= warmup), None)
    b = None
    for s in samples:
        if s[1] < steps:
            b = s
    if a is None or b is None or b[0] - a[0] <= 0:
        return None
    dt = b[0] - a[0]
    pids = [pid for pid in b[2] if pid in a[2]]
    workers = sorted((b[2][pid][0], pid) for pid in pids if pid != cli_pid)
    order = [cli_pid] + [pid for _, pid in workers]
    cores, faults = [], []
    for pid in order:
        if pid in a[2] and pid in b[2]:
            cores.append((b[2][pid][1] - a[2][pid][1]) / CLK_TCK / dt)
            faults.append((b[2][pid][2] - a[2][pid][2]) / dt)
        else:
            cores.append(float("nan"))
            faults.append(float("nan"))
    return cores, faults


def total_cpu(samples):
    """CPU seconds of every process over the whole run (last sample each)."""
    last = {}
    for _, _, cpu in samples:
        for pid, (_, ticks, _) in cpu.items():
            last[pid] = ticks
    return sum(last.values()) / CLK_TCK


def window_mean(times):
    return sum(times) / len(times) if times else float("nan")


def summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    return int(s["batch_size"]), int(s["microbatches"]), s.get("digest", "")


def fmt_cores(c):
    return "/".join(f"{x:.2f}" for x in c)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder for runs")
    ap.add_argument("--interlock", required=True)
    ap.add_argument("--config", action="append", required=True,
                    metavar="NAME=PATH")
    ap.add_argument("--modes", default="e2e 1")
    ap.add_argument("--engines", default="inprocess cluster")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--poll", type=float, default=0.2)
    args = ap.parse_args()

    configs = [c.split("=", 1) for c in args.config]
    modes = args.modes.split()
    for mode in modes:
        mode_flags(mode)  # refuses an unknown mode before any run
    engines = args.engines.split()
    env = dict(os.environ)
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[v] = str(args.threads)

    pairs = [(c, m) for c in configs for m in modes]
    runs = {}  # (config name, mode, engine) -> list of per-run dicts
    log = open(os.path.join(args.work, "runs.jsonl"), "a")
    for r in range(args.rounds):
        for i in range(len(pairs)):
            (name, path), mode = pairs[(i + r) % len(pairs)]
            eng_order = engines if (r + i) % 2 == 0 else engines[::-1]
            for eng in eng_order:
                run_dir = os.path.join(args.work, f"{name}.{mode}.{eng}.r{r}")
                cmd = [args.interlock, "train", "--config", path,
                       *mode_flags(mode), "--engine", eng,
                       "--threads-per-block", str(args.threads),
                       "--schedule", "sequential", "--quiet",
                       "--steps", str(args.steps), "--out", run_dir]
                samples, wall, stall, pid, rc = run_one(cmd, run_dir,
                                                        args.poll, env)
                if rc != 0:
                    print(f"run failed (rc {rc}): {' '.join(cmd)}",
                          file=sys.stderr)
                    with open(run_dir + ".log") as f:
                        sys.stderr.write(f.read()[-3000:])
                    return 1
                times = step_times(os.path.join(run_dir, "metrics.jsonl"),
                                   args.warmup)
                batch, m, digest = summary(run_dir)
                window = window_cores(samples, pid, args.warmup, args.steps)
                cores, faults = window if window else (None, None)
                rec = {"config": name, "mode": mode, "engine": eng,
                       "round": r, "dir": run_dir, "wall": wall,
                       "stall": stall / 1e6 / wall if wall > 0 else 0.0,
                       "times": times, "batch": batch, "m": m,
                       "digest": digest, "cores": cores, "faults": faults,
                       "cpu_total": total_cpu(samples)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                runs.setdefault((name, mode, eng), []).append(rec)
                print(f"  round {r + 1}/{args.rounds} {name} M={m} {mode} "
                      f"{eng}: {wall:.1f} s, mean step {window_mean(times):.3f}"
                      f" s, cores "
                      f"{fmt_cores(cores) if cores else 'n/a'}",
                      file=sys.stderr)

    print("| config | M | mode | engine | s/step (median of run means) | "
          "samples/s | cluster / in-process | vs E2E, same engine | "
          "run means by round (s) | "
          "median / p10 of single steps (s) | steps timed | CPU stall | "
          "cores: coordinator/worker 0/worker 1/… | CPU s/step (all processes) "
          "| page faults/step: coordinator/worker 0/worker 1/… |")
    print("|---|---:|---|---|---:|---:|---|---:|---|---|---:|---:|---|---:|---|")
    medians = {}
    for key, rows in runs.items():
        means = [window_mean(row["times"]) for row in rows if row["times"]]
        medians[key] = statistics.median(means) if means else float("nan")
    checks = []
    for (name, _), mode in pairs:
        for eng in engines:
            key = (name, mode, eng)
            rows = runs.get(key)
            if not rows:
                continue
            pooled = [t for row in rows for t in row["times"]]
            med = medians[key]
            batch = rows[0]["batch"]
            ref = medians.get((name, mode, "inprocess"))
            ratio = ("1.00" if eng == "inprocess" else
                     f"{med / ref:.2f} time, {ref / med:.2f}x samples/s"
                     if ref else "n/a")
            e2e = medians.get((name, "e2e", eng))
            vs_e2e = f"{med / e2e:.2f}" if e2e else "n/a"
            per_round = "/".join(f"{window_mean(row['times']):.3f}"
                                 for row in sorted(rows, key=lambda x: x["round"])
                                 if row["times"])
            stall = statistics.mean(row["stall"] for row in rows)
            cores = [row["cores"] for row in rows if row["cores"]]
            n = max((len(c) for c in cores), default=0)
            mean_cores = [statistics.mean(c[j] for c in cores if len(c) > j)
                          for j in range(n)]
            cpu_step = sum(mean_cores) * med if mean_cores else float("nan")
            flt = [row["faults"] for row in rows if row["faults"]]
            mean_flt = [statistics.mean(f[j] for f in flt if len(f) > j) * med
                        for j in range(max((len(f) for f in flt), default=0))]
            flt_txt = "/".join(f"{x / 1000:.1f}k" for x in mean_flt)
            print(f"| {name} | {rows[0]['m']} | {MODE_LABELS.get(mode, mode)} "
                  f"| {eng} | {med:.3f} | {batch / med:.0f} | {ratio} | "
                  f"{vs_e2e} | {per_round} | {statistics.median(pooled):.3f} / "
                  f"{percentile(pooled, 10):.3f} | {len(pooled)} "
                  f"| {100 * stall:.0f}% | {fmt_cores(mean_cores)} | "
                  f"{cpu_step:.3f} | {flt_txt} |")
            if eng != "inprocess" and ref:
                checks.append((name, rows[0]["m"], mode, med / ref, ref / med))
    print()
    print("| config | M | mode | cluster / in-process step time | "
          "cluster / in-process samples/s |")
    print("|---|---:|---|---:|---:|")
    for name, m, mode, t_ratio, s_ratio in checks:
        print(f"| {name} | {m} | {MODE_LABELS.get(mode, mode)} | "
              f"{t_ratio:.2f} | {s_ratio:.2f} |")
    # Same parameters from both engines (one thread per block): a cheap
    # check that both ran the same computation.
    print()
    for (name, _), mode in pairs:
        d = {row["digest"] for eng in engines
             for row in runs.get((name, mode, eng), [])}
        print(f"digests {name} {mode}: "
              f"{'all equal' if len(d) == 1 else f'{len(d)} different'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

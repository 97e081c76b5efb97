#!/usr/bin/env python3
"""Roofline line for the side-by-side benchmark (issue 15).

1. Measures what one core does (one intra-op thread, fp32, through the same
   LibTorch 1.13 kernels our engine calls): a 1024 x 1024 matmul and a 3x3
   convolution of 64 channels (batch 64, 64 x 32 x 32, padding 1).
2. Counts the floating-point operations of one training step of the config's
   model in each mode, from the model itself: forward hooks on every Conv2d,
   Linear and BatchNorm2d of the blocks and heads record each layer's forward
   FLOPs from its actual input and output shapes; the backward passes each
   mode runs (the pass structure of interlock_ref.py and of our engine) turn
   them into a step's total. Counting rule:

     forward       conv: 2 * out elements * in channels/groups * kh * kw
                   linear: 2 * out elements * in features
                   batch norm: 2 * elements (one multiply-add once folded)
                   ReLU, additions, pooling, loss: not counted (memory-bound,
                   under 1 % of the arithmetic)
     parameter pass (backward with the parameters as inputs): per layer its
                   weight gradient (= forward FLOPs) plus its input gradient
                   (= forward FLOPs), except that a layer reading the block's
                   input computes no input gradient unless the block sends
                   the pass's input gradient upstream (block 0 never does);
                   autograd skips it (checked: a conv backward with only the
                   weight as input takes half the time)
     input-gradient-only pass: input gradients only, = the block's forward
     head:         forward + weight and input gradients = 3 x its forward
     optimizer:    not counted (about 6 FLOPs per parameter, < 0.1 %)

3. Given the measured median step times (--times, a TSV of mode, Python
   s/step, Interlock s/step), prints the achieved GFLOP/s of each and its
   share of the measured convolution throughput of one core. That throughput
   is the best call, not the median: other load on the machine only ever
   slows a call down, and the best is the stricter yardstick. Measured with
   glibc malloc set as our binaries set it (tune_allocator).

Usage: roofline.py [--config FILE] [--modes "e2e 1 2 3"] [--times FILE]
                   [--seconds S]
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interlock_ref as ref  # noqa: E402


def measure(fn, flops, seconds):
    """GFLOP/s of fn(): (median, best) over calls filling `seconds`."""
    for _ in range(2):  # Warm-up: allocator, oneDNN primitive caches.
        fn()
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(rates) < 5:
        t = time.perf_counter()
        fn()
        rates.append(flops / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates), max(rates)


def tune_allocator():
    """glibc malloc as our binaries set it up (services/runtime.cc).

    With glibc's defaults every convolution call here faulted in about 12,000
    fresh pages (its 16 MiB output and oneDNN's buffers) and ran at 55-68
    GFLOP/s instead of 94-98. The roofline is about the kernels.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt parameters from <malloc.h>.
    m_trim_threshold, m_mmap_threshold, m_mmap_max, m_arena_max = -1, -3, -4, -8
    ok = all(libc.mallopt(p, v) == 1 for p, v in (
        (m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30),
        (m_mmap_max, 0), (m_arena_max, 1)))
    return ok


def machine(seconds):
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    mm = measure(lambda: torch.mm(a, b), 2 * 1024 ** 3, seconds)
    conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    x = torch.randn(64, 64, 32, 32)
    with torch.no_grad():
        cv = measure(lambda: conv(x), 2 * 64 * 64 * 9 * 64 * 32 * 32, seconds)
    return mm, cv


def layer_flops(module, inp, out):
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return 2 * out.numel() * (module.in_channels // module.groups) * kh * kw
    if isinstance(module, nn.Linear):
        return 2 * out.numel() * module.in_features
    if isinstance(module, nn.BatchNorm2d):
        return 2 * out.numel()
    return 0


def forward_flops(module, x):
    """(total, of layers that read x itself) forward FLOPs of module(x)."""
    counts = {"all": 0, "first": 0}

    def hook(m, inputs, out):
        f = layer_flops(m, inputs[0], out)
        counts["all"] += f
        if inputs[0] is x:
            counts["first"] += f

    handles = [m.register_forward_hook(hook) for m in module.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d))]
    with torch.no_grad():
        out = module(x)
    for h in handles:
        h.remove()
    return counts["all"], counts["first"], out


def step_flops(cfg, mode):
    """FLOPs of one training step, and its parts, for the mode."""
    e2e, n, sum_rule = ref.parse_mode(mode)
    blocks, heads = ref.build_model(cfg, with_heads=not e2e)
    L = ref.Lists(len(blocks), e2e, n, sum_rule)
    x = torch.zeros([cfg["batch"]] + cfg["shape"])
    parts = {"forward": 0, "heads": 0, "parameter passes": 0,
             "input-only passes": 0}
    for k, block in enumerate(blocks):
        f, first, out = forward_flops(block, x)
        parts["forward"] += f
        if heads[k] is not None:
            h, _, _ = forward_flops(heads[k], out)
            parts["heads"] += 3 * h
        # The parameter pass computes the input gradient of the block's first
        # layers only when it yields an entry for upstream.
        parts["parameter passes"] += 2 * f - (0 if L.shared(k) >= 0
                                              else first)
        parts["input-only passes"] += L.early_count(k) * f
        x = out
    return sum(parts.values()), parts


def conv_bound(cfg, seconds, channels_last):
    """What the convolutions of one E2E step take when each runs alone.

    Every Conv2d of the model (one of each distinct shape, times how often it
    occurs) is timed by itself, one thread, median over calls filling
    `seconds`: its forward, then its backward for the weight and, except for
    the layer that reads the images, the input. Their sum is what E2E's
    convolutions cost at these shapes with nothing else in the step: batch
    norm, ReLU, additions and the optimizer are left out. Returns the rows
    (shape, count, GFLOP, seconds per step) and the totals.
    """
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    blocks, _ = ref.build_model(cfg, with_heads=False)
    seen = {}
    x = torch.zeros([cfg["batch"]] + cfg["shape"])
    images = x

    def hook(m, inputs, out):
        key = (tuple(inputs[0].shape), m.out_channels, m.kernel_size,
               m.stride, m.padding, inputs[0] is images)
        if key not in seen:
            seen[key] = [m, 0, layer_flops(m, inputs[0], out)]
        seen[key][1] += 1

    handles = [m.register_forward_hook(hook) for b in blocks
               for m in b.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        for b in blocks:
            x = b(x)
    for h in handles:
        h.remove()
    backward = torch.ops.aten.convolution_backward
    rows, total_t, total_f = [], 0.0, 0
    for (shape, cout, k, stride, pad, reads_images), (m, count, f) in \
            seen.items():
        inp = torch.randn(shape).contiguous(memory_format=fmt)
        w = m.weight.detach().contiguous(memory_format=fmt)
        out = torch.nn.functional.conv2d(inp, w, None, stride, pad)
        g = torch.randn_like(out).contiguous(memory_format=fmt)
        mask = [not reads_images, True, False]
        times = []
        for fn in (lambda: torch.nn.functional.conv2d(inp, w, None, stride,
                                                      pad),
                   lambda: backward(g, inp, w, None, list(stride), list(pad),
                                    [1, 1], False, [0, 0], 1, mask)):
            med, _ = measure(fn, 1e9, seconds / 4)
            times.append(1.0 / med)  # measure() gives calls' 1/s here
        flops = f * (3 if not reads_images else 2)
        t = count * sum(times)
        rows.append((shape, cout, k[0], stride[0], count, count * flops, t))
        total_t += t
        total_f += count * flops
    return rows, total_t, total_f


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench/resnet_ref_k4.pbtxt")
    ap.add_argument("--modes", default="e2e 1 2 3")
    ap.add_argument("--times", help="TSV: mode, Python s/step, Interlock s/step")
    ap.add_argument("--seconds", type=float, default=2.0,
                    help="time per throughput measurement")
    ap.add_argument("--conv-bound", action="store_true",
                    help="also time each convolution of an E2E step alone, "
                    "in NCHW and channels-last (the ceiling the kernels set)")
    args = ap.parse_args()
    cfg = ref.read_config(args.config)

    # First as a plain process has it, for comparison with figures measured
    # that way (mallopt cannot be undone, so this order).
    (mm0, mm0_best), (cv0, cv0_best) = machine(args.seconds)
    tuned = tune_allocator()
    (mm, mm_best), (cv, cv_best) = machine(args.seconds)
    print("One core, fp32, 1 thread, calls over %g s, best (median):"
          % args.seconds)
    print()
    print("| glibc malloc | matmul 1024^2 GFLOP/s | conv 3x3 64->64 32x32 "
          "batch 64 GFLOP/s |")
    print("|---|---:|---:|")
    print("| defaults | %.1f (%.1f) | %.1f (%.1f) |"
          % (mm0_best, mm0, cv0_best, cv0))
    print("| %s | %.1f (%.1f) | %.1f (%.1f) |"
          % ("as in our binaries" if tuned else "tuning FAILED, defaults",
             mm_best, mm, cv_best, cv))
    print()
    print("Shares below are of the best conv call with malloc as in our "
          "binaries (%.1f GFLOP/s)." % cv_best)
    print()

    times = {}
    if args.times:
        with open(args.times) as f:
            for line in f:
                p = line.split()
                if len(p) == 3:
                    times[p[0]] = (float(p[1]), float(p[2]))

    print("| mode | GFLOP/step | forward | heads | parameter passes | "
          "input-only passes | Python GFLOP/s (% of conv) | "
          "Interlock GFLOP/s (% of conv) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split():
        total, parts = step_flops(cfg, mode)
        cells = []
        for t in times.get(mode, (0.0, 0.0)):
            if t > 0:
                rate = total / t / 1e9
                cells.append("%.1f (%.0f %%)" % (rate, 100 * rate / cv_best))
            else:
                cells.append("n/a")
        print("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %s |" % (
            ref.mode_label(mode), total / 1e9, parts["forward"] / 1e9,
            parts["heads"] / 1e9, parts["parameter passes"] / 1e9,
            parts["input-only passes"] / 1e9, cells[0], cells[1]))
    print()
    print("E2E runs one block at a time, so its share is of one core. The "
          "other modes keep up to K blocks busy at once (one thread each), so "
          "their share can exceed 100 %, up to min(K, cores) x 100 %.")
    if args.conv_bound:
        print()
        print("E2E's convolutions, each timed alone (forward + backward; "
              "median of calls), per step:")
        print()
        print("| input | out ch | k | stride | count | GFLOP | NCHW s | "
              "channels-last s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        nchw = conv_bound(cfg, args.seconds, False)
        nhwc = conv_bound(cfg, args.seconds, True)
        for a, b in zip(nchw[0], nhwc[0]):
            print("| %s | %d | %d | %d | %d | %.3f | %.4f | %.4f |" % (
                "x".join(map(str, a[0])), a[1], a[2], a[3], a[4], a[5] / 1e9,
                a[6], b[6]))
        for name, (_, t, f) in (("NCHW", nchw), ("channels-last", nhwc)):
            print()
            print("%s: %.3f s for %.2f GFLOP of convolutions = %.1f GFLOP/s, "
                  "%.0f %% of the best conv call" % (
                      name, t, f / 1e9, f / t / 1e9,
                      100 * f / t / 1e9 / cv_best))
    return 0


if __name__ == "__main__":
    sys.exit(main())

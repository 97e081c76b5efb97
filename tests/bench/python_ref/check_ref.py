#!/usr/bin/env python3
"""Checks that interlock_ref.py trains every block with the loss DESIGN §1 says.

For each mode it runs the threaded reference for one step and takes each
block's parameter gradients just before its optimizer step. It then rebuilds
the same model (same seed, so the same values), runs the first batch through
the chain without any detaching, and differentiates directly:

    E2E         theta[k] <- L[K-1]
    n FURTHEST  theta[k] <- L[min(k+n-1, K-1)]
    n SUM       theta[k] <- L[k] + ... + L[min(k+n-1, K-1)]

The gradients must agree to float rounding. It also prints the number of
input-gradient-only passes per block, to compare with our engine's
(docs/BENCHMARKS.md: 2-way 0,1,1,0; 3-way 0,1,1,0 once unused entries are
skipped; 4-way 0,0,0,0).

Usage: check_ref.py [--config FILE] [--modes "e2e 1 2 3 4 2sum 3sum"]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import interlock_ref as ref  # noqa: E402


def direct_gradients(cfg, mode, x, y):
    e2e, n, sum_rule = ref.parse_mode(mode)
    blocks, heads = ref.build_model(cfg, with_heads=not e2e)
    K = len(blocks)
    acts, a = [], x
    for b in blocks:
        a = b(a)
        acts.append(a)
    losses = [F.cross_entropy(heads[k](acts[k]), y) if heads[k] is not None
              else None for k in range(K - 1)]
    losses.append(F.cross_entropy(acts[-1], y))
    grads = []
    for k in range(K):
        if e2e:
            js = [K - 1]
        elif sum_rule:
            js = list(range(k, min(k + n - 1, K - 1) + 1))
        else:
            js = [min(k + n - 1, K - 1)]
        total = sum(losses[j] for j in js)
        grads.append(torch.autograd.grad(total, list(blocks[k].parameters()),
                                         retain_graph=True))
    return grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench/resnet_ref_k4.pbtxt")
    ap.add_argument("--modes", default="e2e 1 2 3 4 2sum 3sum")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = ref.read_config(args.config)
    failed = False
    for mode in args.modes.split():
        run, (x_all, y_all, gen) = ref.prepare(cfg, mode, steps=1)
        got = {}
        run.before_step = lambda k, s, params: got.__setitem__(
            k, [p.grad.clone() for p in params])
        # The first batch, from a generator in the same state as train()'s.
        probe = torch.Generator().manual_seed(cfg["seed"])
        ref.synthetic_images(cfg, probe)
        idx = torch.randperm(x_all.shape[0], generator=probe)[:cfg["batch"]]
        run.train(x_all, y_all, gen)
        want = direct_gradients(cfg, mode, x_all[idx], y_all[idx])
        worst = 0.0
        for k, ws in enumerate(want):
            for g, w in zip(got[k], ws):
                err = ((g - w).abs().max() / (w.abs().max() + 1e-12)).item()
                worst = max(worst, err)
        ok = worst < 1e-4
        failed |= not ok
        print("%-5s %s  worst relative difference %.1e  input-only passes %s"
              % (mode, "ok  " if ok else "FAIL", worst, run.early_passes))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

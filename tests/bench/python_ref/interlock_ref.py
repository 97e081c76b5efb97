#!/usr/bin/env python3
"""A plain PyTorch reference for the side-by-side benchmark (issue 15).

Trains the model of a ResNet benchmark config (configs/bench/resnet_ref_k4.pbtxt)
in E2E, n-way FURTHEST or n-way SUM mode the way our engine does with
`--schedule threaded` and one intra-op thread per block: one Python thread per
block, activations and gradient entries travelling between them through queues.
LibTorch kernels release the GIL, so the blocks compute concurrently; what is
left serialised is the Python code around them, which is the cost this
benchmark is meant to show.

It is written to do the same arithmetic as our engine, pass for pass
(services/trainer.cc, services/driver.cc, plan/gradient_lists.h; the rule
is DESIGN §1):

* every block but the last has an auxiliary head that sees the block's output
  detached; its loss trains the head and yields the block's own gradient entry;
* block k's list is [own entry, entries from block k+1...]; FURTHEST trains
  theta[k] with the last entry, SUM with their sum;
* the entry the parameter pass can yield on the way (the input gradient of the
  entry that trains theta) comes from that pass; every other entry sent
  upstream gets an input-gradient-only pass, run as soon as the entry exists;
* entries no block trains on (FURTHEST: losses below min(n-1, K-1)) are
  neither computed nor sent;
* a block starts the next step's forward only after its optimizer step, and
  at most 2K steps are in flight (the coordinator's window at M = 1).

Writes OUT/metrics.jsonl in the format of `interlock train` (one line per step:
step, wall_seconds when the step had finished on every block, per-block loss),
so tests/bench/step_time_stats.py reads both alike.

Only one micro-batch per step, basic residual blocks and image heads made of
convN, bn, relu, gbpl, fc and fcN are supported; anything else is refused
rather than approximated.
"""
import argparse
import json
import math
import os
import queue
import re
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- config

def read_config(path):
    """The few fields of a run config this script needs.

    A regular-expression reader, not a text-format parser: the benchmark
    configs are flat enough, and a missing or unexpected field fails loudly.
    """
    with open(path) as f:
        text = re.sub(r"#[^\n]*", "", f.read())

    def section(name):
        """The text between `name {` and its closing brace."""
        m = re.search(r"\b%s\s*\{" % name, text)
        if not m:
            sys.exit("interlock_ref: %s: no section '%s'" % (path, name))
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        return text[m.end():i - 1]

    def field(sec, name, default=None):
        m = re.search(r"\b%s\s*:\s*(\"[^\"]*\"|\[[^\]]*\]|[^\s}]+)" % name,
                      sec)
        if not m:
            if default is None:
                sys.exit("interlock_ref: %s: no field '%s'" % (path, name))
            return default
        v = m.group(1)
        if v.startswith('"'):
            return v[1:-1]
        if v.startswith("["):
            return [int(t) for t in v[1:-1].split(",") if t.strip()]
        return v

    model, data = section("model"), section("data")
    opt, training = section("optimizer"), section("training")
    c = {
        "architecture": field(model, "architecture"),
        "block_type": field(model, "block_type", "basic"),
        "stem_planes": int(field(model, "stem_planes", "0")),
        "partition": field(model, "partition"),
        "head": field(model, "head"),
        "data": field(data, "kind"),
        "shape": field(data, "synthetic_shape"),
        "classes": int(field(data, "synthetic_classes", "10")),
        "train": int(field(data, "synthetic_train", "512")),
        "optimizer": field(opt, "kind"),
        "momentum": float(field(opt, "momentum", "0")),
        "nesterov": field(opt, "nesterov", "false") == "true",
        "weight_decay": float(field(opt, "weight_decay", "0")),
        "schedule": field(section("schedule"), "kind"),
        "lr": float(field(section("schedule"), "lr")),
        "batch": int(field(training, "batch_size")),
        "microbatches": int(field(training, "microbatches", "1")),
        "seed": int(field(training, "seed", "1")),
    }
    if c["data"] != "SYNTHETIC_IMAGES":
        sys.exit("interlock_ref: only data kind SYNTHETIC_IMAGES is supported")
    if c["schedule"] != "CONSTANT":
        sys.exit("interlock_ref: only schedule kind CONSTANT is supported")
    if c["optimizer"] != "SGD":
        sys.exit("interlock_ref: only optimizer kind SGD is supported")
    if c["block_type"] != "basic":
        sys.exit("interlock_ref: only block_type basic is supported")
    if c["microbatches"] != 1:
        sys.exit("interlock_ref: only one micro-batch per step is supported")
    if len(c["shape"]) != 3:
        sys.exit("interlock_ref: synthetic_shape must be [C, H, W]")
    return c


# ---------------------------------------------------------------- model
# The same layers, in the same order and with the same default
# initialisation, as services/resnet.cc and models.cc build (values differ:
# another random stream).

class Stem(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride=stride, padding=1,
                               bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = None
        if stride != 1 or cin != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + (self.shortcut(x) if self.shortcut is not None else x)
        return F.relu(out)


class GlobalPool(nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


class Classifier(nn.Module):
    def __init__(self, cin, classes):
        super().__init__()
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(x.mean((2, 3)) if x.dim() == 4 else x)


def build_units(cfg):
    """Stem, residual blocks, classifier; and the channels after each."""
    stages = []
    for stage in cfg["architecture"].split("/"):
        planes, count = (int(t) for t in stage.split(","))
        stages.append((planes, count))
    cin = cfg["shape"][0]
    stem = cfg["stem_planes"] or stages[0][0]
    units, channels = [Stem(cin, stem)], [stem]
    c = stem
    for i, (planes, count) in enumerate(stages):
        for b in range(count):
            units.append(BasicBlock(c, planes, 2 if i > 0 and b == 0 else 1))
            c = planes
            channels.append(c)
    units.append(Classifier(c, cfg["classes"]))
    channels.append(cfg["classes"])
    return units, channels


def split_partition(partition, units):
    """Units per block; "rest" (at most once) takes what the others leave."""
    parts = partition.split(",")
    fixed = sum(int(p) for p in parts if p != "rest")
    counts = [units - fixed if p == "rest" else int(p) for p in parts]
    if (parts.count("rest") > 1 or sum(counts) != units
            or min(counts) <= 0):
        sys.exit("interlock_ref: partition '%s' does not cover %d units"
                 % (partition, units))
    return counts


def build_head(spec, channels, classes):
    layers, image = [], True
    for tok in spec.split("_"):
        if tok.startswith("conv"):
            width = int(tok[4:])
            layers.append(nn.Conv2d(channels, width, 3, padding=1, bias=False))
            channels = width
        elif tok == "bn":
            layers += [nn.BatchNorm2d(channels), nn.ReLU()]
        elif tok == "relu":
            layers.append(nn.ReLU())
        elif tok == "gbpl":
            layers.append(GlobalPool())
            image = False
        elif tok.startswith("fc"):
            if image:
                # Our engine flattens C*H*W here; this script does not know H
                # and W, so such heads are refused.
                sys.exit("interlock_ref: head '%s': fc on an image activation"
                         " is not supported (put gbpl first)" % spec)
            out = int(tok[2:]) if tok[2:] else classes
            layers.append(nn.Linear(channels, out))
            if tok[2:]:
                layers.append(nn.ReLU())
            channels = out
        else:
            sys.exit("interlock_ref: head layer '%s' is not supported" % tok)
    return nn.Sequential(*layers)


def build_model(cfg, with_heads):
    """K blocks (nn.Sequential) and K-1 heads (None in E2E)."""
    torch.manual_seed(cfg["seed"])
    units, channels = build_units(cfg)
    counts = split_partition(cfg["partition"], len(units))
    blocks, outs, i = [], [], 0
    for c in counts:
        blocks.append(nn.Sequential(*units[i:i + c]))
        outs.append(channels[i + c - 1])
        i += c
    heads = [None] * len(blocks)
    if with_heads:
        for k in range(len(blocks) - 1):
            heads[k] = build_head(cfg["head"], outs[k], cfg["classes"])
    return blocks, heads


# ---------------------------------------------------------------- lists

class Lists:
    """Lengths of the capped gradient lists; mirrors gradient_lists.h."""

    def __init__(self, blocks, e2e, n, sum_rule):
        self.K, self.e2e, self.n, self.sum_rule = blocks, e2e, n, sum_rule
        # FURTHEST trains block b with loss min(b+n-1, K-1): the losses below
        # min(n-1, K-1) train no block, so their entries are never computed.
        self.first_used = 0 if e2e or sum_rule else min(n - 1, blocks - 1)

    def used(self, k, i):
        return k + i >= self.first_used

    def down(self, k):
        if k + 1 >= self.K:
            return 0
        return 1 if self.e2e else min(self.n - 1, self.K - k - 1)

    def up(self, k):
        if k == 0:
            return 0
        return 1 if self.e2e else min(self.n - 1, self.K - k)

    def unused_down(self, k):
        return max(0, min(self.first_used - (k + 1), self.down(k)))

    def shared(self, k):
        """The upstream entry the parameter pass yields, or -1."""
        up = self.up(k)
        if up == 0:
            return -1
        if self.e2e:
            return 0
        last = self.down(k)
        shared = last if (not self.sum_rule or last == 0) else -1
        return shared if shared < up else -1

    def early(self, k, i):
        """Entry i goes upstream through an input-gradient-only pass."""
        return (0 <= i < self.up(k) and i != self.shared(k)
                and self.used(k, i))

    def early_count(self, k):
        return sum(self.early(k, i) for i in range(self.up(k)))


# ---------------------------------------------------------------- data

def synthetic_images(cfg, gen):
    """Class patterns in [-1, 1] plus Gaussian noise (std 0.5), as
    services/data_images.cc makes them (another random stream)."""
    shape, classes, n = cfg["shape"], cfg["classes"], cfg["train"]
    patterns = torch.rand([classes] + shape, generator=gen) * 2 - 1
    y = torch.randint(classes, (n,), generator=gen)
    x = patterns[y] + 0.5 * torch.randn([n] + shape, generator=gen)
    return x, y


# ---------------------------------------------------------------- training

class Run:
    def __init__(self, cfg, lists, blocks, heads, steps):
        self.cfg, self.L, self.steps = cfg, lists, steps
        self.blocks, self.heads = blocks, heads
        K = len(blocks)
        self.fwd_q = [queue.Queue() for _ in range(K)]   # from block k-1
        self.grad_q = [queue.Queue() for _ in range(K)]  # from block k+1
        # The coordinator's window: 2K micro-batches in flight (M = 1).
        self.window = threading.Semaphore(2 * K)
        self.lock = threading.Lock()
        self.finished = [0] * steps
        self.wall = [0.0] * steps
        self.losses = [[None] * K for _ in range(steps)]
        self.errors = []
        self.t0 = None
        # For check_ref.py: input-gradient-only passes per block, and a
        # callback that sees block k's parameters before its step s.
        self.early_passes = [0] * K
        self.before_step = None
        self.channels_last = False

    def step_done(self, k, s):
        with self.lock:
            self.finished[s] += 1
            if self.finished[s] == len(self.blocks):
                self.wall[s] = time.perf_counter() - self.t0
                self.window.release()

    def block_loop(self, k):
        try:
            self._block_loop(k)
        except BaseException as e:  # Report and unblock the feeder.
            self.errors.append("block %d: %r" % (k, e))
            for _ in range(self.steps):
                self.window.release()

    def _block_loop(self, k):
        # Thread settings are per thread in OpenMP: set them on every block's
        # thread, as the engine does (services/runtime.cc ConfigureThreads).
        torch.set_num_threads(1)
        L, cfg = self.L, self.cfg
        K = len(self.blocks)
        last = k == K - 1
        block, head = self.blocks[k], self.heads[k]
        params = list(block.parameters())
        trained = params + (list(head.parameters()) if head is not None
                            else [])
        opt = torch.optim.SGD(trained, lr=cfg["lr"], momentum=cfg["momentum"],
                              nesterov=cfg["nesterov"],
                              weight_decay=cfg["weight_decay"])
        up, down = L.up(k), L.down(k)
        shared = L.shared(k)
        for s in range(self.steps):
            x, y = self.fwd_q[k].get()
            if self.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            # Only a block that sends gradients upstream needs its input's.
            inp = x.detach().requires_grad_(True) if up > 0 else x
            out = block(inp)
            # The output goes down before the head runs, as our engine sends
            # it (services/driver.cc): the next block does not wait for it.
            if not last:
                self.fwd_q[k + 1].put((out.detach(), y))
            own = None
            if not L.e2e or last:
                # The head (or the model's loss) sees the output detached: its
                # update reaches the block only through the gradient list.
                det = out.detach().requires_grad_(True)
                logits = det if last else head(det)
                loss = F.cross_entropy(logits, y)
                loss.backward()
                own = det.grad
                self.losses[s][k] = loss.item()

            def send_early(i, g):
                gin, = torch.autograd.grad(out, inp, g, retain_graph=True)
                self.early_passes[k] += 1
                self.grad_q[k - 1].put((i, gin))

            # List entry 0 is the own gradient; downstream entry j is list
            # entry j + 1. Each goes upstream as soon as it exists.
            if L.early(k, 0):
                send_early(0, own)
            entries = [None] * down
            for _ in range(down - L.unused_down(k)):
                j, g = self.grad_q[k].get()
                entries[j] = g
                if L.early(k, j + 1):
                    send_early(j + 1, g)
            lst = ([own] if own is not None else []) + entries
            theta_grad = lst[-1]
            if L.sum_rule:
                for g in reversed(lst[:-1]):
                    theta_grad = theta_grad + g
            inputs = params + ([inp] if shared >= 0 else [])
            torch.autograd.backward(out, theta_grad, inputs=inputs)
            if shared >= 0:
                self.grad_q[k - 1].put((shared, inp.grad))
            if self.before_step is not None:
                self.before_step(k, s, params)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.step_done(k, s)

    def train(self, x_all, y_all, gen):
        threads = [threading.Thread(target=self.block_loop, args=(k,),
                                    daemon=True)
                   for k in range(len(self.blocks))]
        batch, n = self.cfg["batch"], x_all.shape[0]
        per_epoch = n // batch
        self.t0 = time.perf_counter()
        for t in threads:
            t.start()
        perm = None
        for s in range(self.steps):
            self.window.acquire()
            if self.errors:
                break
            if s % per_epoch == 0:
                perm = torch.randperm(n, generator=gen)
            idx = perm[(s % per_epoch) * batch:(s % per_epoch + 1) * batch]
            self.fwd_q[0].put((x_all[idx], y_all[idx]))
        # A failed block leaves its neighbours waiting on their queues for
        # ever: stop waiting at the first error (the threads are daemons).
        for t in threads:
            while t.is_alive() and not self.errors:
                t.join(0.1)
        if self.errors:
            # os._exit: interpreter shutdown with block threads still inside
            # LibTorch aborts instead of exiting.
            print("interlock_ref: " + "; ".join(self.errors), file=sys.stderr,
                  flush=True)
            os._exit(1)


def parse_mode(mode):
    """e2e, N (FURTHEST) or Nsum (SUM) -> (e2e, n, sum_rule)."""
    if mode == "e2e":
        return True, 1, False
    m = re.fullmatch(r"(\d+)(sum)?", mode)
    if not m or int(m.group(1)) < 1:
        sys.exit("interlock_ref: mode '%s', expected e2e, N or Nsum" % mode)
    return False, int(m.group(1)), m.group(2) is not None


def mode_label(mode):
    """The names tests/bench/step_time_stats.py uses."""
    e2e, n, sum_rule = parse_mode(mode)
    if e2e:
        return "E2E"
    if n == 1:
        return "1-way"
    return "%d-way %s" % (n, "sum" if sum_rule else "furthest")


def prepare(cfg, mode, steps, channels_last=False):
    """A Run for the mode, and the arguments of its train()."""
    e2e, n, sum_rule = parse_mode(mode)
    blocks, heads = build_model(cfg, with_heads=not e2e)
    if channels_last:
        for m in blocks + [h for h in heads if h is not None]:
            m.to(memory_format=torch.channels_last)
    lists = Lists(len(blocks), e2e, n, sum_rule)
    gen = torch.Generator().manual_seed(cfg["seed"])
    x_all, y_all = synthetic_images(cfg, gen)
    run = Run(cfg, lists, blocks, heads, steps)
    run.channels_last = channels_last
    return run, (x_all, y_all, gen)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/bench/resnet_ref_k4.pbtxt")
    ap.add_argument("--mode", default="e2e", help="e2e, N or Nsum")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True, help="folder for metrics.jsonl")
    ap.add_argument("--memory-format", default="contiguous",
                    choices=["contiguous", "channels_last"],
                    help="layout of the 4-D tensors (a plain script: "
                    "contiguous, whatever the config's model.resnet."
                    "memory_format says)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    cfg = read_config(args.config)
    run, data = prepare(cfg, args.mode, args.steps,
                        args.memory_format == "channels_last")
    run.train(*data)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
        for s in range(args.steps):
            loss = [None if v is None or math.isnan(v) else v
                    for v in run.losses[s]]
            f.write(json.dumps({"step": s, "wall_seconds": run.wall[s],
                                "loss": loss}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

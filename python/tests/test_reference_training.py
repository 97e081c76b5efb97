"""The scripted model family against PyTorch: E2E training of exported
TorchScript units by `interlock train` equals a plain PyTorch loop over the
same units (parameters and losses after 5 SGD steps, to 1e-5), and the
cluster engine's parameters equal the in-process engine's bitwise in every
mode.

Needs the built CLI: $INTERLOCK_CLI, else build/coordinator/interlock of
this checkout (the cluster runs also its interlock-worker); skipped when it
is missing.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch
import torch.nn.functional as F

from interlock.export import _quote
from tests.examples import load_example

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.normpath(os.path.join(_HERE, "..", ".."))
_CLI = os.environ.get("INTERLOCK_CLI") or os.path.join(
    _ROOT, "build", "coordinator", "interlock")

# 5 units (1x28x28 -> 16x14x14 -> 16x14x14 -> 32x7x7 -> 32x7x7 -> 10) in
# 3 blocks: the cut after unit 1 has the export's user head, the cut after
# unit 3 gets `head` (only the interlocking modes train heads). Units 2 and
# 3 hand on channels-last strided activations (a convolution of a permuted
# LayerNorm output), and unit 2 a strided input gradient: both cross a cut.
_PARTITION = "2,2,rest"
_COUNTS = [2, 2, 1]
_HEAD = "gbpl_fc"
_SAMPLES = 8
_CLASSES = 10
_STEPS = 5
_SEED = 1
# The config holds float32; the reference uses the very same values.
_LR = torch.tensor(0.1, dtype=torch.float32).item()
_MOMENTUM = torch.tensor(0.9, dtype=torch.float32).item()
_TOLERANCE = 1e-5
_RUN_TIMEOUT_S = 120

# (label, training { ... } fields): the modes the engines must agree in.
_MODES = [
    ("e2e", "mode: E2E"),
    ("1-way", "mode: INTERLOCK n: 1 rule: FURTHEST"),
    ("2-way furthest", "mode: INTERLOCK n: 2 rule: FURTHEST"),
    ("2-way sum", "mode: INTERLOCK n: 2 rule: SUM"),
]



def _float_list(t):
    # repr of a float32 value as a double reads back as that float32.
    return ", ".join(repr(v) for v in t.reshape(-1).tolist())


def _dump_name(block, position, name):
    """The dump's name of parameter `name` of the unit at `position` in
    block `block`: TorchScript's dotted names with '.' -> '__'."""
    return f"block{block}.block.{position}.{name.replace('.', '__')}"


def _relative_diff(got, want):
    """max |got - want| / max(1, |want|), elementwise."""
    return ((got - want).abs() / want.abs().clamp(min=1.0)).max().item()


class ReferenceTrainingTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not os.path.isfile(_CLI) or not os.access(_CLI, os.X_OK):
            raise unittest.SkipTest(
                f"the interlock CLI {_CLI} does not exist (build it, or set "
                "INTERLOCK_CLI to its path)")
        cls._tmp = tempfile.TemporaryDirectory()
        cls.tmp = cls._tmp.name
        cls._threads = torch.get_num_threads()
        cls._optimize = torch._C._get_graph_executor_optimize()
        # What the C++ side does: one intra-op thread per block and the
        # graph executor without optimisation, so both run the same kernels.
        torch.set_num_threads(1)
        torch._C._set_graph_executor_optimize(False)

        cls.export = load_example().export(os.path.join(cls.tmp, "model"))
        g = torch.Generator().manual_seed(7)
        cls.inputs = torch.randn(_SAMPLES, 1, 28, 28, generator=g)
        cls.targets = torch.randint(0, _CLASSES, (_SAMPLES,), generator=g)
        cls.runs = {}

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls._threads)
        torch._C._set_graph_executor_optimize(cls._optimize)
        cls._tmp.cleanup()

    # ------------------------------------------------------------- the CLI

    def _config(self, training, momentum):
        optimizer = "optimizer { kind: SGD"
        if momentum:
            optimizer += f" momentum: {momentum!r}"
        optimizer += " }"
        return "\n".join([
            'name: "reference_training"',
            "model {",
            f"  scripted {{ path: {_quote(self.export.out_dir)} }}",
            f"  partition: {_quote(_PARTITION)}",
            f"  head: {_quote(_HEAD)}",
            "}",
            "data {",
            "  kind: INLINE",
            "  synthetic_shape: [1, 28, 28]",
            f"  synthetic_classes: {_CLASSES}",
            f"  inline_inputs: [{_float_list(self.inputs)}]",
            "  inline_targets: "
            f"[{', '.join(str(t) for t in self.targets.tolist())}]",
            "}",
            optimizer,
            f"schedule {{ kind: CONSTANT lr: {_LR!r} }}",
            f"training {{ {training} batch_size: {_SAMPLES} microbatches: 1 "
            f"steps: {_STEPS} seed: {_SEED} threads_per_block: 1 }}",
            "",
        ])

    def _train(self, label, training, engine, momentum=0.0):
        """Runs `interlock train` once per (mode, engine, momentum):
        {'params': {name: tensor}, 'lines': the dump's lines, 'digest',
        'losses': per step, the list of every block's loss}."""
        key = (training, engine, momentum)
        if key in self.runs:
            return self.runs[key]
        run_dir = tempfile.mkdtemp(prefix="run", dir=self.tmp)
        config = os.path.join(run_dir, "config.pbtxt")
        with open(config, "w", encoding="utf-8") as f:
            f.write(self._config(training, momentum))
        out = os.path.join(run_dir, "out")
        cmd = [_CLI, "train", "--config", config, "--engine", engine,
               "--dump-params", "--out", out]
        try:
            p = subprocess.run(cmd, cwd=run_dir, capture_output=True,
                               text=True, timeout=_RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            self.fail(f"{label}, {engine}: {' '.join(cmd)} took over "
                      f"{_RUN_TIMEOUT_S} s; stderr:\n{e.stderr}")
        if p.returncode != 0:
            self.fail(f"{label}, {engine}: {' '.join(cmd)} exited "
                      f"{p.returncode}; stderr:\n{p.stderr[-4000:]}")
        run = {"params": {}, "lines": [], "digest": None, "losses": []}
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                run["lines"].append(line)
                run["params"][d["name"]] = torch.tensor(
                    d["values"], dtype=torch.float64).reshape(d["shape"])
            elif line.startswith("digest "):
                run["digest"] = line.split()[1]
        self.assertTrue(run["lines"], f"{label}, {engine}: no parameter "
                        f"dump on stdout:\n{p.stdout[-2000:]}")
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            steps = [json.loads(line) for line in f if line.strip()]
        self.assertEqual([s["step"] for s in steps], list(range(_STEPS)),
                         f"{label}, {engine}: metrics.jsonl")
        # As written: a block without a loss has the string "NaN".
        run["losses"] = [s["loss"] for s in steps]
        self.runs[key] = run
        return run

    # ------------------------------------------------------- the reference

    def _reference(self, momentum, dtype=torch.float32):
        """A plain PyTorch loop: the units chained, cross-entropy averaged
        over the batch, torch.optim.SGD. Returns (units, losses)."""
        units = [torch.jit.load(os.path.join(self.export.out_dir, f))
                 .to(dtype).train() for f in self.export.unit_files]
        params = [p for u in units for p in u.parameters()]
        opt = torch.optim.SGD(params, lr=_LR, momentum=momentum)
        losses = []
        for _ in range(_STEPS):
            opt.zero_grad()
            x = self.inputs.to(dtype)
            for u in units:
                x = u(x)
                # The gradient leaving a unit, contiguous as a cut's wire
                # delivers it. The values are the same; the layout matters
                # to PyTorch 1.13 (Python and LibTorch alike), whose
                # float32 gelu_backward reads uninitialised memory when the
                # incoming gradient is strided (pytorch/pytorch#112006):
                # here unit 2's ChannelNorm (a permute) hands unit 1's
                # residual, and so unit 0's GELU, a permuted gradient.
                x.register_hook(lambda g: g.contiguous())
            loss = F.cross_entropy(x, self.targets)
            losses.append(loss.item())
            loss.backward()
            opt.step()
        return units, losses

    def _expected_params(self, units):
        """{dump name: tensor} of every unit's parameters, by block."""
        out, i = {}, 0
        for k, count in enumerate(_COUNTS):
            for j in range(count):
                for name, p in units[i].named_parameters():
                    out[_dump_name(k, j, name)] = p.detach()
                i += 1
        self.assertEqual(i, len(units))
        return out

    # ----------------------------------------------------------- the tests

    def test_e2e_equals_pytorch(self):
        for momentum in (0.0, _MOMENTUM):
            with self.subTest(momentum=momentum):
                run = self._train("e2e", "mode: E2E", "inprocess", momentum)
                units, ref_losses = self._reference(momentum)
                want = self._expected_params(units)
                # The reference itself, against the same loop in float64:
                # a broken kernel would show here, not as a C++ bug.
                units64, losses64 = self._reference(momentum, torch.float64)
                for name, p64 in self._expected_params(units64).items():
                    self.assertLessEqual(
                        _relative_diff(want[name].double(), p64), _TOLERANCE,
                        f"{name}: the float32 PyTorch loop is off its float64 "
                        "twin")
                for a, b in zip(ref_losses, losses64):
                    self.assertLessEqual(abs(a - b) / max(1.0, abs(b)),
                                         _TOLERANCE)
                blocks = {n: t for n, t in run["params"].items()
                          if ".block." in n}
                self.assertEqual(sorted(blocks), sorted(want),
                                 "the blocks' parameter names in the dump")
                worst, where = 0.0, None
                for name, ref in want.items():
                    got = blocks[name]
                    self.assertEqual(list(got.shape), list(ref.shape), name)
                    d = _relative_diff(got, ref.double())
                    if d > worst:
                        worst, where = d, name
                    self.assertLessEqual(d, _TOLERANCE, name)
                # In E2E only the last block has a loss.
                got_losses = [float(s[-1]) for s in run["losses"]]
                loss_diff = max(abs(a - b) / max(1.0, abs(b))
                                for a, b in zip(got_losses, ref_losses))
                self.assertLessEqual(
                    loss_diff, _TOLERANCE,
                    f"losses {got_losses} vs PyTorch {ref_losses}")
                # The units trained: a loop that did nothing passes no test.
                self.assertLess(ref_losses[-1], ref_losses[0])
                print(f"\n  E2E momentum {momentum:g}: {len(want)} "
                      f"parameters, max relative difference {worst:.3g} "
                      f"({where}); losses max difference {loss_diff:.3g} "
                      f"(PyTorch {ref_losses[0]:.6f} -> "
                      f"{ref_losses[-1]:.6f})", file=sys.stderr)

    def test_cluster_equals_inprocess(self):
        for label, training in _MODES:
            with self.subTest(mode=label):
                a = self._train(label, training, "inprocess")
                b = self._train(label, training, "cluster")
                self.assertEqual(list(a["params"]), list(b["params"]))
                differ = [n for n, la, lb in zip(a["params"], a["lines"],
                                                  b["lines"]) if la != lb]
                if differ:
                    worst = max(differ, key=lambda n: (
                        a["params"][n] - b["params"][n]).abs().max().item())
                    gap = (a["params"][worst] -
                           b["params"][worst]).abs().max().item()
                    self.fail(f"{label}: {len(differ)} of {len(a['lines'])} "
                              "parameters differ between the in-process and "
                              f"the cluster engine, e.g. {differ[:3]}; most "
                              f"{worst}, by {gap:.3g}")
                self.assertEqual(a["digest"], b["digest"])
                self.assertEqual(a["losses"], b["losses"])


if __name__ == "__main__":
    unittest.main()

"""Tests of interlock.build_networks against the C++ side's own numbers.

For each built-in family (ResNet basic and bottleneck, the transformer with
GELU and RELU, the MLP) and a scripted model, a short run of the CLI
(`interlock train`, 3 steps, checkpointed), `interlock export`, then
build_networks; the whole network and every early exit, loaded back from
TorchScript, must reproduce the run's final evaluation on the test split:
per-exit loss (mean cross-entropy, coordinator/evaluation.cc) within 1e-5
relative and accuracy exactly. The data is INLINE (or a TEXT file written
here), so the test split is known in Python.

Needs the built CLI with its `export` command: $INTERLOCK_CLI, else
build/coordinator/interlock of this checkout; skipped without it.
"""

import gzip
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from interlock import build_networks, export_model, load_exit
from tests.examples import load_example
from interlock.exported import build_modules, read_export, read_pbtxt

torch.set_num_threads(1)

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.normpath(os.path.join(_HERE, "..", ".."))
_CLI = os.environ.get("INTERLOCK_CLI") or os.path.join(
    _ROOT, "build", "coordinator", "interlock")
_RTOL = 1e-5
_STEPS = 3

_cli_missing = None  # why the tests skip (None: not yet asked)


def _cli_skip_reason():
    global _cli_missing
    if _cli_missing is not None:
        return _cli_missing or None
    if not (os.path.isfile(_CLI) and os.access(_CLI, os.X_OK)):
        _cli_missing = (f"no interlock CLI at {_CLI} (build it, or set "
                        "INTERLOCK_CLI to its path)")
    else:
        p = subprocess.run([_CLI, "export"], capture_output=True, text=True,
                           timeout=60)
        out = p.stdout + p.stderr
        _cli_missing = (f"{_CLI} has no export command"
                        if "unknown command 'export'" in out else "")
    return _cli_missing or None


def _run(cmd, cwd):
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {p.returncode}:\n"
            f"{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout + p.stderr


def _floats(t):
    # float64 repr of float32 values: read back as the same float32.
    return ", ".join(repr(float(v)) for v in t.reshape(-1).tolist())


def _inline_data(x, y, classes):
    shape = ", ".join(str(d) for d in x.shape[1:])
    return (f"data {{ kind: INLINE synthetic_shape: [{shape}] "
            f"synthetic_classes: {classes}\n"
            f"  inline_inputs: [{_floats(x)}]\n"
            f"  inline_targets: [{', '.join(str(int(v)) for v in y)}] }}\n")


def _config(name, model, data, batch, optimizer="kind: SGD momentum: 0.9",
            lr=0.05, training=""):
    return (f'name: "{name}"\nmodel {{ {model} }}\n{data}'
            f"optimizer {{ {optimizer} }}\n"
            f"schedule {{ kind: CONSTANT lr: {lr} }}\n"
            f"training {{ mode: INTERLOCK n: 2 batch_size: {batch} "
            f"microbatches: 2 steps: {_STEPS} seed: 3 eval_batch_size: 512 "
            f"{training} }}\n")


def _images(n, shape, classes, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n,) + tuple(shape), generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def _text(length, seed):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij")
                     for _ in range(rng.randint(2, 6))) for _ in range(20)]
    out = []
    while sum(len(w) + 1 for w in out) < length:
        out.append(rng.choice(words))
    return (" ".join(out) + "\n")[:length].encode("ascii")


def _text_test_split(data, context):
    """services/data_text.cc: the test windows (the last 5% of the bytes)."""
    n = len(data)
    begin = n * 95 // 100
    test = data[begin:]
    windows = (len(test) - 1) // context
    x = torch.tensor([[test[i * context + t] for t in range(context)]
                      for i in range(windows)], dtype=torch.long)
    y = torch.tensor([[test[i * context + t + 1] for t in range(context)]
                      for i in range(windows)], dtype=torch.long)
    return x, y



class ExportedNetworksTest(unittest.TestCase):

    def setUp(self):
        reason = _cli_skip_reason()
        if reason:
            self.skipTest(reason)
        self.dir = tempfile.mkdtemp(prefix="interlock_exported_")

    def tearDown(self):
        if hasattr(self, "dir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers

    def train_and_export(self, config):
        path = os.path.join(self.dir, "run.pbtxt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(config)
        out = os.path.join(self.dir, "out")
        _run([_CLI, "train", "--config", path, "--steps", str(_STEPS),
              "--out", out, "--checkpoint-every", str(_STEPS)], self.dir)
        export = os.path.join(self.dir, "export")
        _run([_CLI, "export", "--run", out, "--to", export], self.dir)
        with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
        return export, summary

    def check(self, export, summary, x, y, blocks):
        """Every network of `export` against the run's final evaluation."""
        files = build_networks(export)
        self.assertEqual(sorted(files), [-1] + list(range(blocks - 1)))
        exp = read_export(export)
        # proto3 text format leaves out a zero exit_block.
        listed = {n.get("file"): int(n.get("exit_block", 0))
                  for n in exp.all("networks")}
        self.assertEqual(
            listed, {os.path.basename(p): k for k, p in files.items()})
        self.assertEqual([int(d) for d in exp.all("input_shape")],
                         list(x.shape[1:]))
        # A second call writes nothing and keeps the files.
        stamps = {p: os.stat(p).st_mtime_ns for p in files.values()}
        self.assertEqual(build_networks(export), files)
        self.assertEqual(
            stamps, {p: os.stat(p).st_mtime_ns for p in files.values()})

        evals = {e["block"]: e for e in summary["eval"]}
        self.assertEqual(sorted(evals), list(range(blocks)))
        modules = build_modules(export)
        for k in range(blocks):
            net = load_exit(export, None if k == blocks - 1 else k)
            self.assertFalse(net.training)
            with torch.no_grad():
                logits = net(x)
                direct = modules[-1 if k == blocks - 1 else k](x)
            self.assertEqual(logits.shape[-1], int(exp.get("classes")))
            # TorchScript computes what the PyTorch modules do.
            torch.testing.assert_close(logits, direct, rtol=1e-6, atol=1e-6)
            flat = logits.reshape(-1, logits.size(-1))
            loss = F.cross_entropy(flat, y.reshape(-1),
                                   reduction="sum").item() / y.numel()
            correct = int(logits.argmax(-1).eq(y).sum())
            want = evals[k]
            self.assertLessEqual(
                abs(loss - want["loss"]), _RTOL * abs(want["loss"]),
                f"exit {k}: loss {loss!r} here, {want['loss']!r} in the run")
            self.assertAlmostEqual(correct / y.numel(), want["accuracy"],
                                   places=12, msg=f"exit {k}: accuracy")
        return files

    # -------------------------------------------------------------- tests

    def test_resnet_basic_channels_last(self):
        x, y = _images(12, (3, 8, 8), 4, seed=1)
        model = ('resnet { architecture: "4,1/8,1" memory_format: '
                 'CHANNELS_LAST } partition: "2,1,rest" '
                 'head: "conv4_bn_gbpl_fc"')
        export, summary = self.train_and_export(
            _config("resnet_basic", model, _inline_data(x, y, 4), 12))
        self.check(export, summary, x, y, blocks=3)

    def test_resnet_bottleneck_flatten_head(self):
        x, y = _images(8, (1, 6, 6), 3, seed=2)
        model = ('resnet { architecture: "2,1/4,1" block_type: "bottleneck" '
                 'stem_planes: 4 } partition: "1,1,rest" '
                 'head: "conv4_relu_fc"')
        export, summary = self.train_and_export(
            _config("resnet_bottleneck", model, _inline_data(x, y, 3), 8))
        self.check(export, summary, x, y, blocks=3)

    def test_mlp_on_images(self):
        x, y = _images(10, (2, 3, 3), 5, seed=3)
        model = ('mlp { hidden: [16, 12, 8] } partition: "1,2,rest" '
                 'head: "fc16_ln_fc"')
        export, summary = self.train_and_export(
            _config("mlp", model, _inline_data(x, y, 5), 10))
        self.check(export, summary, x, y, blocks=3)

    def test_transformer_gelu(self):
        self._transformer("", "ln_fc")

    def test_transformer_relu_layer_head(self):
        self._transformer("activation: RELU d_ff: 24", "layer_ln_fc")

    def _transformer(self, extra, head):
        context = 8
        data = _text(4000, seed=4)
        path = os.path.join(self.dir, "corpus.txt")
        with open(path, "wb") as f:
            f.write(data)
        x, y = _text_test_split(data, context)
        model = (f"transformer {{ d_model: 16 layers: 2 heads: 2 "
                 f"context: {context} {extra} }} partition: \"1,2,rest\" "
                 f"head: \"{head}\"")
        export, summary = self.train_and_export(_config(
            "transformer", model, f'data {{ kind: TEXT path: "{path}" }}\n', 8,
            optimizer="kind: ADAMW weight_decay: 0.01", lr=0.003))
        exp = read_export(export)
        self.assertEqual(exp.get("input_dtype"), "int64")
        self.check(export, summary, x, y, blocks=3)

    def test_scripted_small_cnn(self):
        cnn = load_example()
        models = os.path.join(self.dir, "models", "small_cnn")
        cnn.export(models)
        x, y = _images(6, (1, 28, 28), 10, seed=5)
        with open(os.path.join(_ROOT, "configs", "scripted_cnn_k3.pbtxt"),
                  encoding="utf-8") as f:
            ready = read_pbtxt(f.read())
        model = ready.msg("model")
        spec = (f'scripted {{ path: "models/small_cnn" }} '
                f'partition: "{model.get("partition")}" '
                f'head: "{model.get("head")}"')
        export, summary = self.train_and_export(
            _config("scripted", spec, _inline_data(x, y, 10), 6))
        written_by_export = {n.get("file") for n in
                             read_export(export).all("networks")}
        # interlock export writes the network and the user head's exit; the
        # exit on the head string (after unit 3) is built here.
        self.assertIn("network.pt", written_by_export)
        self.assertNotIn("exit_1.pt", written_by_export)
        stamp = os.stat(os.path.join(export, "network.pt")).st_mtime_ns
        self.check(export, summary, x, y, blocks=3)
        self.assertEqual(
            stamp, os.stat(os.path.join(export, "network.pt")).st_mtime_ns)

    def test_build_module_command(self):
        x, y = _images(4, (3,), 2, seed=6)
        model = 'mlp { hidden: [4] } partition: "1,rest" head: "fc"'
        export, summary = self.train_and_export(
            _config("cmd", model, _inline_data(x, y, 2), 4))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(_ROOT, "python")] +
            [p for p in [os.environ.get("PYTHONPATH")] if p]))
        p = subprocess.run([sys.executable, "-m", "interlock.build", export],
                           capture_output=True, text=True, env=env,
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(os.path.isfile(os.path.join(export, "network.pt")))
        self.assertTrue(os.path.isfile(os.path.join(export, "exit_0.pt")))
        self.check(export, summary, x, y, blocks=2)

        # Loading is strict: a tensor missing, one too many, another shape.
        path = os.path.join(export, "weights.pt")
        weights = torch.load(path)
        for name, change in [
                ("1.block.0.bias", lambda w: w.pop("1.block.0.bias")),
                ("0.head.9.weight",
                 lambda w: w.update({"0.head.9.weight": torch.zeros(1)})),
                ("0.block.0.fc.weight",
                 lambda w: w.update({"0.block.0.fc.weight":
                                     torch.zeros(4, 2)})),
        ]:
            bad = dict(weights)
            change(bad)
            torch.save(bad, path)
            with self.assertRaisesRegex(ValueError, name.replace(".", r"\.")):
                build_networks(export, overwrite=True)


_FMNIST = "/usr/share/datasets/fashion-mnist"


def _fmnist_test(n):
    """The first n test images (uint8 [n, 1, 28, 28]) and labels."""
    with gzip.open(os.path.join(_FMNIST, "t10k-images-idx3-ubyte.gz")) as f:
        images = f.read()[16:16 + n * 784]
    with gzip.open(os.path.join(_FMNIST, "t10k-labels-idx1-ubyte.gz")) as f:
        labels = f.read()[8:8 + n]
    x = torch.tensor(list(images), dtype=torch.uint8).reshape(n, 1, 28, 28)
    return x, torch.tensor(list(labels), dtype=torch.long)


# A causal LM that takes exactly `context` tokens: its positions and mask
# are used whole, so a shorter input fails.
class _FixedEmbed(nn.Module):
    def __init__(self, vocab, context, width):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids):
        return self.tokens(ids) + self.positions


class _FixedCausal(nn.Module):
    def __init__(self, context, width):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.register_buffer(
            "mask", torch.full((context, context), -math.inf).triu(1))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + self.mask
        return x + self.out(a.softmax(-1) @ v)


class UsingExportsTest(unittest.TestCase):
    """What a user does with a trained run besides evaluating it: networks
    that prepare their own inputs, predict on a file, generate from a
    scripted language model of fixed context."""

    setUp = ExportedNetworksTest.setUp
    tearDown = ExportedNetworksTest.tearDown
    train_and_export = ExportedNetworksTest.train_and_export
    check = ExportedNetworksTest.check

    def test_networks_normalise_and_predict_reads_a_file(self):
        if not os.path.isfile(os.path.join(_FMNIST,
                                           "t10k-images-idx3-ubyte.gz")):
            self.skipTest(f"no Fashion-MNIST in {_FMNIST} (scripts/setup.sh)")
        cnn = load_example()
        cnn.export(os.path.join(self.dir, "models", "small_cnn"))
        spec = ('scripted { path: "models/small_cnn" } partition: "2,2,rest" '
                'head: "gbpl_fc"')
        n = 40
        data = (f"data {{ kind: FASHION_MNIST max_train: 64 max_test: {n} "
                f"}}\n")
        export, summary = self.train_and_export(
            _config("fmnist", spec, data, 8))
        raw, y = _fmnist_test(n)
        # The networks take images scaled to [0, 1], as ToTensor gives them,
        # and normalise them as training did.
        scaled = raw.float() / 255
        self.check(export, summary, scaled, y, blocks=3)
        exp = read_export(export)
        for k in (None, 0, 1):
            net = load_exit(export, k)
            self.assertEqual(list(net.input_shape), [1, 28, 28])
            self.assertEqual(net.input_dtype, "float32")
            self.assertEqual(list(net.class_names), exp.all("class_names"))
            self.assertEqual(len(net.class_names), 10)
            self.assertFalse(net.language_model)
            self.assertTrue(net.normalise)
        # `interlock predict --input` on the raw bytes as .npy labels them
        # as the exported network does.
        path = os.path.join(self.dir, "images.npy")
        np.save(path, raw.numpy())
        out = _run([_CLI, "predict", "--run", os.path.join(self.dir, "out"),
                    "--input", path, "--count", str(n)], self.dir)
        with torch.no_grad():
            want = load_exit(export).forward(scaled).argmax(-1).tolist()
        lines = [l for l in out.splitlines() if l.startswith(path)]
        self.assertEqual(len(lines), n, out)
        for i, line in enumerate(lines):
            name = exp.all("class_names")[want[i]]
            self.assertIn(f"{path}[{i}]: class {want[i]} \"{name}\"", line)
        # One sample without a batch dimension; a wrong shape is refused.
        np.save(path, raw[3].numpy())
        out = _run([_CLI, "predict", "--run", os.path.join(self.dir, "out"),
                    "--input", path], self.dir)
        self.assertIn(f"{path}[0]: class {want[3]} ", out)
        np.save(path, raw[:, :, :27].numpy())
        p = subprocess.run([_CLI, "predict", "--run",
                            os.path.join(self.dir, "out"), "--input", path],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 1)
        self.assertIn(f"{path}: shape ({n}, 1, 27, 28), expected", p.stderr)

    def test_generate_from_a_fixed_context_scripted_lm(self):
        context, width = 8, 16
        torch.manual_seed(4)
        units = [_FixedEmbed(256, context, width),
                 _FixedCausal(context, width), _FixedCausal(context, width),
                 nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 256))]
        models = os.path.join(self.dir, "models", "lm")
        export_model(units, torch.randint(0, 256, (2, context)), models,
                     loss="tokens")
        data = _text(3000, seed=8)
        path = os.path.join(self.dir, "corpus.txt")
        with open(path, "wb") as f:
            f.write(data)
        spec = 'scripted { path: "models/lm" } partition: "2,rest" head: "ln_fc"'
        _, _ = self.train_and_export(_config(
            "lm", spec, f'data {{ kind: TEXT path: "{path}" }}\n', 8,
            optimizer="kind: ADAMW", lr=0.003))
        run = os.path.join(self.dir, "out")
        # Bytes, not UTF-8: what an untrained model samples.
        p = subprocess.run([_CLI, "generate", "--run", run, "--prompt", "ab",
                            "--tokens", "12", "--temperature", "0"],
                           cwd=self.dir, capture_output=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        text = p.stdout[:-1]  # the line's newline
        self.assertEqual(len(text), 14)
        # Greedy decoding by hand with the exported network: the prompt in
        # a whole window, zeros after it (causal: they change nothing).
        net = load_exit(os.path.join(self.dir, "export"))
        ids = list(b"ab")
        with torch.no_grad():
            for _ in range(12):
                window = ids[-context:]
                x = torch.tensor([window + [0] * (context - len(window))])
                ids.append(int(net(x)[0, len(window) - 1].argmax()))
        self.assertEqual(text, bytes(ids))
        # The same as token ids.
        out = _run([_CLI, "generate", "--run", run, "--prompt-ids", "97 98",
                    "--tokens", "12", "--temperature", "0"], self.dir)
        self.assertEqual(out.strip().split("\n")[-1],
                         " ".join(str(i) for i in ids))


class TextFormatTest(unittest.TestCase):

    def test_reads_what_protobuf_prints(self):
        m = read_pbtxt(
            '# comment\nconfig {\n  name: "a\\"b\\303\\251"\n  model { mlp '
            '{ hidden: 8 hidden: 6 } }\n  data { kind: INLINE '
            'inline_inputs: [1e-05, -0.5, 2] }\n}\nstep: 3\nmean: 0.5\n'
            'language_model: true\n')
        self.assertEqual(m.msg("config").get("name"), 'a"b\u00e9')
        self.assertEqual(m.msg("config").msg("model").msg("mlp").all("hidden"),
                         [8, 6])
        self.assertEqual(
            m.msg("config").msg("data").all("inline_inputs"), [1e-05, -0.5, 2])
        self.assertEqual(m.msg("config").msg("data").get("kind"), "INLINE")
        self.assertEqual(
            (m.get("step"), m.get("mean"), m.get("language_model")),
            (3, 0.5, True))


if __name__ == "__main__":
    unittest.main()

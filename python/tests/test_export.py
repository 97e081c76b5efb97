"""Tests of interlock.export_model: files, model.pbtxt, reloading, refusals."""

import hashlib
import math
import os
import re
import tempfile
import unittest
import warnings

import torch
from torch import nn

from interlock import export_model
from tests.examples import load_example
from interlock.export import _quote

torch.set_num_threads(1)

_HERE = os.path.dirname(os.path.abspath(__file__))



cnn = load_example()


# ------------------------------------------------- protobuf text, read back

_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\\n]|\\.)*"|[{}:]|[\w.+-]+')


def _unquote(literal):
    body, out, i = literal[1:-1], bytearray(), 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8")
            i += 1
        elif body[i + 1] in "01234567":
            out.append(int(body[i + 1:i + 4], 8))
            i += 4
        else:
            out += {"n": b"\n", "t": b"\t"}.get(body[i + 1],
                                                body[i + 1].encode())
            i += 2
    return out.decode("utf-8")


def parse_pbtxt(text):
    """Just enough protobuf text format: {field: [values]}, messages nested."""
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"bad text at {pos}: {text[pos:pos + 20]!r}")
        pos = m.end()
        if not m.group().isspace() and not m.group().startswith("#"):
            tokens.append(m.group())

    def message(i, end):
        fields = {}
        while i < len(tokens) and tokens[i] != end:
            name = tokens[i]
            if tokens[i + 1] == "{":
                value, i = message(i + 2, "}")
                i += 1
            else:
                assert tokens[i + 1] == ":", tokens[i:i + 3]
                raw = tokens[i + 2]
                value = (_unquote(raw) if raw.startswith('"') else
                         int(raw) if re.fullmatch(r"-?\d+", raw) else raw)
                i += 3
            fields.setdefault(name, []).append(value)
        return fields, i

    return message(0, None)[0]


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ------------------------------------------------------------ a tiny LM


class Embed(nn.Module):
    def __init__(self, vocab, context, width):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(context, width) * 0.02)

    def forward(self, ids):
        return self.tokens(ids) + self.positions[:ids.shape[1]]


class Decoder(nn.Module):
    """One pre-norm decoder layer; the causal mask is a buffer."""

    def __init__(self, context, width, heads):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.1, batch_first=True,
            norm_first=True)
        mask = torch.full((context, context), -math.inf).triu(1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        t = x.shape[1]
        return self.layer(x, src_mask=self.mask[:t, :t])


def tiny_lm(vocab=256, context=16, width=32):
    return [Embed(vocab, context, width), Decoder(context, width, 4),
            Decoder(context, width, 4),
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))]


# ------------------------------------------------------------ bad units


class TwoInputs(nn.Module):
    def forward(self, x, skip):
        return x + skip


class ReturnsTuple(nn.Module):
    def forward(self, x):
        return x, x * 2


class UnusedParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


class Detaches(nn.Module):
    def forward(self, x):
        return x.detach() * 2


class Unscriptable(nn.Module):
    """A Python lambda attribute defeats torch.jit.script, not trace."""

    def __init__(self, dropout=None):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.act = lambda t: torch.tanh(t) * 2
        # Even p=0 traces differently in train and eval mode.
        self.drop = nn.Identity() if dropout is None else nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.act(self.linear(x)))


def mlp(*middle):
    return [nn.Linear(4, 8), *middle, nn.Linear(8, 3)]


class ExportCase(unittest.TestCase):

    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def refused(self, pattern, units, sample, **kw):
        with self.assertRaisesRegex(ValueError, pattern):
            export_model(units, sample, os.path.join(self.tmp, "x"), **kw)


class SmallCnnTest(ExportCase):

    def test_export_and_reload(self):
        torch.manual_seed(0)
        units, head = cnn.small_cnn(), cnn.small_cnn_head()
        sample = torch.randn(4, 1, 28, 28)
        before = {k: v.clone() for k, v in units.state_dict().items()}
        names = cnn.CLASS_NAMES + []
        names[0] = 't-"shirt"\\ é'  # escaping round trip
        r = export_model(units, sample, self.tmp, heads={1: head},
                         class_names=names)

        self.assertEqual(sorted(os.listdir(self.tmp)),
                         ["head_after_001.pt", "model.pbtxt", "spec.pbtxt"] +
                         [f"unit_{i:03d}.pt" for i in range(5)])
        self.assertEqual(r.methods, ["script"] * 5)
        self.assertEqual(r.output_shapes, [[16, 14, 14], [16, 14, 14],
                                           [32, 7, 7], [32, 7, 7], [10]])
        m = parse_pbtxt(_read(r.model_pbtxt))
        self.assertEqual(m["torch_version"], [torch.__version__])
        self.assertEqual(m["input_shape"], [1, 28, 28])
        self.assertEqual(m["input_dtype"], ["float32"])
        self.assertEqual(m["loss"], ["CLASSES"])
        self.assertEqual(m["classes"], [10])
        self.assertEqual(m["class_names"], names)
        self.assertEqual(len(m["units"]), 5)
        for i, u in enumerate(m["units"]):
            self.assertEqual(u["file"], [f"unit_{i:03d}.pt"])
            self.assertEqual(u["output_shape"], r.output_shapes[i])
            self.assertEqual(u["sha256"],
                             [_sha256(os.path.join(self.tmp, u["file"][0]))])
            self.assertEqual(u["name"], [type(units[i]).__name__])
        self.assertEqual(m["heads"], [{
            "after_unit": [1], "file": ["head_after_001.pt"],
            "sha256": [_sha256(os.path.join(self.tmp, "head_after_001.pt"))],
        }])
        spec = parse_pbtxt(_read(r.spec_pbtxt))
        self.assertEqual(spec["model"][0]["scripted"][0]["path"],
                         [os.path.abspath(self.tmp)])
        self.assertEqual(spec["model"][0]["head"], ["gbpl_fc"])

        # The train-mode checks must not leave a trace on the weights.
        for k, v in units.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        self.assertTrue(all(p.grad is None for p in units.parameters()))

        x = torch.randn(3, 1, 28, 28)
        units.eval()
        head.eval()
        with torch.no_grad():
            for i, unit in enumerate(units):
                loaded = torch.jit.load(os.path.join(self.tmp,
                                                     r.unit_files[i]))
                self.assertTrue(loaded.training)  # saved for training
                loaded.eval()
                y = unit(x)
                self.assertTrue(torch.equal(loaded(x), y), f"unit {i}")
                if i == 1:
                    h = torch.jit.load(os.path.join(self.tmp,
                                                    "head_after_001.pt"))
                    self.assertTrue(torch.equal(h.eval()(y), head(y)))
                x = y

    def test_example_is_deterministic(self):
        a = cnn.export(os.path.join(self.tmp, "a"))
        b = cnn.export(os.path.join(self.tmp, "b"))
        for f in a.unit_files + list(a.head_files.values()):
            la = torch.jit.load(os.path.join(a.out_dir, f))
            lb = torch.jit.load(os.path.join(b.out_dir, f))
            for (ka, va), (kb, vb) in zip(la.state_dict().items(),
                                          lb.state_dict().items()):
                self.assertEqual(ka, kb)
                self.assertTrue(torch.equal(va, vb), f"{f}: {ka}")


class TinyLmTest(ExportCase):

    def test_export_and_reload(self):
        torch.manual_seed(1)
        units = tiny_lm()
        sample = torch.randint(0, 256, (2, 16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TransformerEncoderLayer's
            r = export_model(units, sample, self.tmp, loss="tokens")
        self.assertEqual(r.output_shapes, [[16, 32]] * 3 + [[16, 256]])
        m = parse_pbtxt(_read(r.model_pbtxt))
        self.assertEqual(m["input_shape"], [16])
        self.assertEqual(m["input_dtype"], ["int64"])
        self.assertEqual(m["loss"], ["TOKENS"])
        self.assertEqual(m["classes"], [256])
        self.assertNotIn("class_names", m)
        self.assertNotIn("heads", m)
        self.assertEqual([u["name"][0] for u in m["units"]],
                         ["Embed", "Decoder", "Decoder", "Sequential"])
        spec = parse_pbtxt(_read(r.spec_pbtxt))
        self.assertEqual(spec["model"][0]["head"], ["ln_fc"])

        x = torch.randint(0, 256, (3, 16))
        with torch.no_grad():
            for i, unit in enumerate(units):
                unit.eval()
                loaded = torch.jit.load(os.path.join(self.tmp,
                                                     r.unit_files[i])).eval()
                y = unit(x)
                self.assertTrue(torch.equal(loaded(x), y), f"unit {i}")
                x = y
        # The mask is causal: a later token does not change earlier outputs.
        loaded = [torch.jit.load(os.path.join(self.tmp, f)).eval()
                  for f in r.unit_files]
        a, b = torch.zeros(1, 16, dtype=torch.int64), torch.zeros(
            1, 16, dtype=torch.int64)
        b[0, 10] = 7
        with torch.no_grad():
            for unit in loaded:
                a, b = unit(a), unit(b)
        self.assertTrue(torch.equal(a[0, :10], b[0, :10]))
        self.assertFalse(torch.equal(a[0, 10:], b[0, 10:]))


class FallbackTest(ExportCase):

    def test_trace_when_script_fails(self):
        torch.manual_seed(0)
        units = mlp(Unscriptable())
        r = export_model(units, torch.randn(5, 4), self.tmp)
        self.assertEqual(r.methods, ["script", "trace", "script"])
        text = _read(r.model_pbtxt)
        self.assertIn("# unit 1: torch.jit.trace", text)
        loaded = torch.jit.load(os.path.join(self.tmp, "unit_001.pt")).eval()
        x = torch.randn(2, 8)
        with torch.no_grad():
            self.assertTrue(torch.equal(loaded(x), units[1].eval()(x)))

    def test_trace_refused_when_mode_matters(self):
        self.refused(r"unit 1 \(Unscriptable\): torch.jit.script fails .*"
                     r"train and eval mode",
                     mlp(Unscriptable(dropout=0.5)), torch.randn(5, 4))


class StateTest(ExportCase):

    def test_weights_statistics_modes_and_rng_untouched(self):
        torch.manual_seed(0)
        units = [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5),
                 nn.Linear(8, 3)]
        units[1].eval()
        units[0].weight.grad = torch.ones_like(units[0].weight)
        before = [{k: v.clone() for k, v in u.state_dict().items()}
                  for u in units]
        sample = torch.randn(5, 4)
        rng = torch.get_rng_state()
        r = export_model(units, sample, self.tmp)
        self.assertTrue(torch.equal(torch.get_rng_state(), rng))
        self.assertEqual([u.training for u in units],
                         [True, False, True, True])
        self.assertTrue(torch.equal(units[0].weight.grad,
                                    torch.ones_like(units[0].weight)))
        self.assertIsNone(units[3].weight.grad)
        for u, b, f in zip(units, before, r.unit_files):
            saved = torch.jit.load(os.path.join(self.tmp, f)).state_dict()
            for k, v in u.state_dict().items():
                self.assertTrue(torch.equal(v, b[k]), k)
                self.assertTrue(torch.equal(saved[k], b[k]), k)


class RefusalTest(ExportCase):

    def test_two_inputs(self):
        self.refused(r"unit 1 \(TwoInputs\): forward takes 2 inputs; a unit "
                     r"takes one tensor and returns one tensor \(a skip "
                     r"connection across a cut",
                     mlp(TwoInputs()), torch.randn(5, 4))

    def test_returns_tuple(self):
        self.refused(r"unit 1 \(ReturnsTuple\): forward returns "
                     r"Tuple\[Tensor, Tensor\]",
                     mlp(ReturnsTuple()), torch.randn(5, 4))

    def test_parameter_without_gradient(self):
        self.refused(r"unit 1 \(UnusedParameter\): parameter 'unused.weight' "
                     r"gets no gradient from the final loss",
                     mlp(UnusedParameter()), torch.randn(5, 4))

    def test_unit_that_detaches(self):
        self.refused(r"unit 1 \(Detaches\): passes no gradient to its input",
                     mlp(Detaches()), torch.randn(5, 4))

    def test_head_with_wrong_shape(self):
        self.refused(r"head after unit 0 \(Linear\): maps \[5, 8\] to "
                     r"\[5, 4\] .*\[B, classes\] = \[5, 3\]",
                     mlp(), torch.randn(5, 4), heads={0: nn.Linear(8, 4)})

    def test_head_parameter_without_gradient(self):
        self.refused(r"head after unit 0 \(Sequential\): parameter "
                     r"'0.unused.weight' gets no gradient from its loss",
                     mlp(), torch.randn(5, 4),
                     heads={0: nn.Sequential(UnusedParameter(),
                                             nn.Linear(8, 3))})

    def test_head_after_the_last_unit(self):
        self.refused(r"heads: unit index 1 out of range",
                     mlp(), torch.randn(5, 4), heads={1: nn.Linear(3, 3)})

    def test_tied_weights(self):
        units = mlp(nn.Linear(8, 8), nn.Linear(8, 8))
        units[2].weight = units[1].weight
        self.refused(r"unit 2 \(Linear\): parameter 'weight' is shared with "
                     r"unit 1", units, torch.randn(5, 4))

    def test_tokens_with_an_image_sample(self):
        self.refused(r"sample_input: torch.float32 of shape \[2, 1, 28, 28\]; "
                     r"loss 'tokens' needs int64 token ids",
                     cnn.small_cnn(), torch.randn(2, 1, 28, 28),
                     loss="tokens")

    def test_classes_with_a_language_model(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.refused(r"final output: shape \[2, 16, 256\]; loss 'classes'"
                         r" needs \[B, classes\] \(a language model",
                         tiny_lm(), torch.randint(0, 256, (2, 16)))

    def test_classes_mismatch(self):
        self.refused(r"final output: shape \[5, 3\], but classes is 7",
                     mlp(), torch.randn(5, 4), classes=7)

    def test_class_names_mismatch(self):
        self.refused(r"class_names: 2 names for 3 classes",
                     mlp(), torch.randn(5, 4), class_names=["a", "b"])

    def test_float64_sample(self):
        self.refused(r"sample_input: dtype torch.float64",
                     mlp(), torch.randn(5, 4, dtype=torch.float64))

    def test_unit_that_fails(self):
        self.refused(r"unit 1 \(Linear\): fails on an input of shape \[5, 8\]",
                     [nn.Linear(4, 8), nn.Linear(9, 3)], torch.randn(5, 4))

    def test_nothing_written_on_refusal(self):
        out = os.path.join(self.tmp, "x")
        self.refused("forward takes 2 inputs", mlp(TwoInputs()),
                     torch.randn(5, 4))
        self.assertFalse(os.path.exists(out))


class QuoteTest(unittest.TestCase):

    def test_escapes(self):
        self.assertEqual(_quote('a"b\\c\nd'), r'"a\"b\\c\nd"')
        self.assertEqual(_quote("é"), r'"\303\251"')
        self.assertEqual(_unquote(_quote('x "é" \\ \n')), 'x "é" \\ \n')


if __name__ == "__main__":
    unittest.main()

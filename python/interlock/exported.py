"""build_networks: a run exported by `interlock export` as TorchScript files.

`interlock export --run OUT --to DIR` writes DIR/export.pbtxt (an
interlock.v1.ExportedModel, proto/export.proto) and DIR/weights.pt (every
parameter and buffer of every block and head, by name). For the built-in
families (resnet, transformer, mlp) this module rebuilds the network in plain
PyTorch as the C++ side builds it (services/resnet.cc, services/transformer.cc,
services/models.cc), cuts it by the export's partition, adds the auxiliary
heads from the head string (services/models.cc, BuildHead), loads the weights
by name (every tensor used, shapes and types equal) and writes, in eval mode:

    DIR/network.pt   the whole network, blocks 0..K-1
    DIR/exit_<k>.pt  blocks 0..k and head k, for every k < K-1

A scripted model's network.pt, and the exits ending in a user's TorchScript
head, are written by `interlock export` itself; only the exits whose head was
built from the head string are added here. The networks take inputs prepared
as in training (ExportedModel.mean / std) and return logits ([B, classes], or
[B, T, vocabulary] for a language model).
"""

import math
import os
import re
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["build_networks", "load_exit", "read_export", "read_pbtxt",
           "Network"]

EXPORT_FILE = "export.pbtxt"


# ------------------------------------------------ protobuf text format, read

class Message:
    """A protobuf text-format message: every field as a list of values
    (scalars as int / float / str / bool / enum name, messages as Message)."""

    def __init__(self, fields: Optional[Dict[str, list]] = None):
        self.fields = fields if fields is not None else {}

    def all(self, name: str) -> list:
        return self.fields.get(name, [])

    def has(self, name: str) -> bool:
        return name in self.fields

    def get(self, name: str, default=None):
        values = self.fields.get(name)
        return values[-1] if values else default

    def msg(self, name: str) -> "Message":
        """The sub-message `name`; an empty one when absent."""
        value = self.get(name)
        return value if isinstance(value, Message) else Message()

    def __repr__(self):
        return f"Message({self.fields!r})"


_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<punct>[{}<>\[\]:;,])
  | (?P<word>[-+]?(?:(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+[fF]?|[\w.]+))
""", re.VERBOSE)

_ESCAPES = {"n": 10, "r": 13, "t": 9, "a": 7, "b": 8, "f": 12, "v": 11,
            "\\": 92, "'": 39, '"': 34, "?": 63}


def _unquote(literal: str) -> str:
    body, out, i = literal[1:-1], bytearray(), 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8")
            i += 1
            continue
        e = body[i + 1]
        if e in "01234567":
            m = re.match(r"[0-7]{1,3}", body[i + 1:])
            out.append(int(m.group(), 8) & 0xFF)
            i += 1 + len(m.group())
        elif e in "xX":
            m = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2:])
            out.append(int(m.group(), 16))
            i += 2 + len(m.group())
        else:
            out.append(_ESCAPES.get(e, ord(e)))
            i += 2
    return out.decode("utf-8", errors="replace")


def _scalar(word: str):
    if re.fullmatch(r"[-+]?\d+", word):
        return int(word)
    if re.fullmatch(r"[-+]?0[xX][0-9a-fA-F]+", word):
        return int(word, 16)
    if word in ("true", "True"):
        return True
    if word in ("false", "False"):
        return False
    for candidate in (word, word.rstrip("fF")):
        try:
            return float(candidate)
        except ValueError:
            pass
    return word  # an enum value's name


def read_pbtxt(text: str) -> Message:
    """Parses protobuf text format without a schema (enough for configs and
    export.pbtxt: messages, repeated fields, [list] values, strings)."""
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError("protobuf text: cannot read "
                             f"{text[pos:pos + 30]!r} at offset {pos}")
        pos = m.end()
        if m.lastgroup != "space":
            tokens.append((m.lastgroup, m.group()))

    def value(i):
        kind, tok = tokens[i]
        if kind == "string":
            s = _unquote(tok)
            # Adjacent literals concatenate.
            while i + 1 < len(tokens) and tokens[i + 1][0] == "string":
                i += 1
                s += _unquote(tokens[i][1])
            return s, i + 1
        if kind == "word":
            return _scalar(tok), i + 1
        if tok in "{<":
            return message(i + 1, "}" if tok == "{" else ">")
        raise ValueError(f"protobuf text: unexpected {tok!r}")

    def message(i, end):
        fields = {}
        while i < len(tokens):
            kind, tok = tokens[i]
            if tok == end and kind == "punct":
                return Message(fields), i + 1
            if tok in (";", ",") and kind == "punct":
                i += 1
                continue
            if kind != "word":
                raise ValueError(f"protobuf text: expected a field name, "
                                 f"got {tok!r}")
            name = tok
            i += 1
            if i < len(tokens) and tokens[i][1] == ":":
                i += 1
            if i < len(tokens) and tokens[i][1] == "[":
                i += 1
                while tokens[i][1] != "]":
                    v, i = value(i)
                    fields.setdefault(name, []).append(v)
                    if tokens[i][1] == ",":
                        i += 1
                i += 1
                fields.setdefault(name, [])
                continue
            v, i = value(i)
            fields.setdefault(name, []).append(v)
        if end is not None:
            raise ValueError("protobuf text: unterminated message")
        return Message(fields), i

    return message(0, None)[0]


def read_export(directory: str) -> Message:
    """DIR/export.pbtxt as a Message (fields of interlock.v1.ExportedModel)."""
    head, tail = _export_text(directory)
    return read_pbtxt(head + tail)


# ---------------------------------------------------------------- shapes

class _Shape:
    """An activation between units (services/models_internal.h, Shape)."""

    IMAGE, VECTOR, SEQUENCE = "image", "vector", "sequence"

    def __init__(self, kind, c, h=1, w=1):
        self.kind, self.c, self.h, self.w = kind, int(c), int(h), int(w)


def _shape_of_dims(dims) -> _Shape:
    """services/scripted.cc, ShapeOf: a unit's declared output shape."""
    dims = [int(d) for d in dims]
    if len(dims) == 3:
        return _Shape(_Shape.IMAGE, *dims)
    if len(dims) == 2:
        return _Shape(_Shape.SEQUENCE, dims[1])
    return _Shape(_Shape.VECTOR, dims[-1])


# --------------------------------------------------------- shared modules

class GlobalPool(nn.Module):
    """Global average pooling to [B, C] (the head layer 'gbpl')."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean([2, 3])


# ---------------------------------------------------------------- ResNet

class Stem(nn.Module):
    """Conv3x3 + BatchNorm + ReLU, fitted to the input channels."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride != 1 or cin != cout:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
            nn.BatchNorm2d(cout))
    return nn.Identity()


class BasicBlock(nn.Module):
    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride=stride, padding=1,
                               bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        out_planes = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut = _shortcut(cin, out_planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


class Classifier(nn.Module):
    """Global average pooling and the linear classifier."""

    def __init__(self, cin: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:
            x = x.mean([2, 3])
        return self.fc(x)


def _resnet_units(spec: Message, input_shape, classes):
    if len(input_shape) != 3:
        raise ValueError("model.resnet: needs image data (channels x height x "
                         f"width), the export's input_shape is {input_shape}")
    channels, h, w = input_shape
    block_type = spec.get("block_type", "") or "basic"
    if block_type not in ("basic", "bottleneck"):
        raise ValueError(f"model.resnet.block_type: '{block_type}', expected "
                         "basic or bottleneck")
    stages = []
    for stage in str(spec.get("architecture", "")).split("/"):
        parts = stage.split(",")
        if len(parts) != 2:
            raise ValueError(f"model.resnet.architecture: stage '{stage}' "
                             "must be 'planes,blocks'")
        stages.append((int(parts[0]), int(parts[1])))
    stem = int(spec.get("stem_planes", 0) or 0) or stages[0][0]
    s = _Shape(_Shape.IMAGE, stem, h, w)
    units = [(Stem(channels, stem), s)]
    cin = stem
    for i, (planes, blocks) in enumerate(stages):
        for b in range(blocks):
            stride = 2 if i > 0 and b == 0 else 1
            if stride == 2:
                s = _Shape(_Shape.IMAGE, s.c, (s.h + 1) // 2, (s.w + 1) // 2)
            if block_type == "basic":
                unit = BasicBlock(cin, planes, stride)
                cin = planes
            else:
                unit = Bottleneck(cin, planes, stride)
                cin = planes * Bottleneck.expansion
            s = _Shape(_Shape.IMAGE, cin, s.h, s.w)
            units.append((unit, s))
    units.append((Classifier(cin, classes), _Shape(_Shape.VECTOR, classes)))
    return units


# ------------------------------------------------------------ transformer

class _TransformerOptions:
    def __init__(self, spec: Message):
        self.d = int(spec.get("d_model", 0))
        self.heads = int(spec.get("heads", 0))
        self.layers = int(spec.get("layers", 0))
        self.context = int(spec.get("context", 0))
        self.d_ff = int(spec.get("d_ff", 0) or 0) or 4 * self.d
        activation = spec.get("activation", "GELU")
        if activation in ("ACTIVATION_UNSPECIFIED", "GELU", 0, 1):
            self.gelu = True
        elif activation in ("RELU", 2):
            self.gelu = False
        else:
            raise ValueError(f"model.transformer.activation: unknown value "
                             f"{activation}; expected GELU or RELU")
        if self.d <= 0 or self.heads <= 0 or self.layers <= 0 or \
                self.context <= 0 or self.d % self.heads:
            raise ValueError("model.transformer: d_model, layers, heads and "
                             "context must be > 0, heads dividing d_model")


class Embedding(nn.Module):
    """Token and position embeddings: [B, T] int64 -> [B, T, D]."""

    def __init__(self, vocab: int, context: int, d: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(context, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.size(1), dtype=torch.long, device=x.device)
        return self.tokens(x) + self.positions(pos).unsqueeze(0)


class DecoderLayer(nn.Module):
    """Pre-LayerNorm decoder layer with causal multi-head self-attention."""

    def __init__(self, d: int, heads: int, d_ff: int, gelu: bool):
        super().__init__()
        self.heads = heads
        self.gelu = gelu
        self.scale = math.sqrt(float(d // heads))
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, d_ff)
        self.fc2 = nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size(0), x.size(1), x.size(2)
        dh = d // self.heads
        parts = self.qkv(self.ln1(x)).split(d, 2)
        q = parts[0].view(b, t, self.heads, dh).transpose(1, 2)
        k = parts[1].view(b, t, self.heads, dh).transpose(1, 2)
        v = parts[2].view(b, t, self.heads, dh).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) / self.scale
        mask = torch.ones([t, t], dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf"))
        att = torch.softmax(att, -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(y)
        f = self.fc1(self.ln2(h))
        f = F.gelu(f) if self.gelu else F.relu(f)
        return h + self.fc2(f)


class LmHead(nn.Module):
    """Final LayerNorm and the language-model head."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x))


def _transformer_units(spec: Message, input_shape, classes):
    o = _TransformerOptions(spec)
    s = _Shape(_Shape.SEQUENCE, o.d, o.context)
    units = [(Embedding(classes, o.context, o.d), s)]
    for _ in range(o.layers):
        units.append((DecoderLayer(o.d, o.heads, o.d_ff, o.gelu), s))
    units.append((LmHead(o.d, classes),
                  _Shape(_Shape.SEQUENCE, classes, o.context)))
    return units


# -------------------------------------------------------------------- MLP

class MlpLayer(nn.Module):
    """Hidden layer of the MLP: (flatten) + linear + ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.fc = nn.Linear(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() > 2:
            x = x.flatten(1)
        return F.relu(self.fc(x))


def _mlp_units(spec: Message, input_shape, classes):
    hidden = [int(h) for h in spec.all("hidden")]
    if not hidden:
        raise ValueError("model.mlp.hidden: needs at least one width")
    cin = 1
    for d in input_shape:
        cin *= int(d)
    units = []
    for width in hidden:
        units.append((MlpLayer(cin, width), _Shape(_Shape.VECTOR, width)))
        cin = width
    units.append((nn.Linear(cin, classes), _Shape(_Shape.VECTOR, classes)))
    return units


# ----------------------------------------------------------------- heads

def build_head(head: str, s: _Shape, classes: int,
               transformer: Optional[_TransformerOptions] = None
               ) -> nn.Sequential:
    """An auxiliary head from a head string (services/models.cc, BuildHead):
    the same layers at the same indices, so parameter names match."""
    if not head:
        raise ValueError("model.head: empty; every block but the last needs "
                         "an auxiliary head")
    layers: List[nn.Module] = []
    for tok in head.split("_"):
        image = s.kind == _Shape.IMAGE

        def bad(why, tok=tok):
            return ValueError(f"model.head: layer '{tok}' in '{head}' {why}")

        if tok.startswith("conv"):
            if not image:
                raise bad("needs an image activation")
            if not tok[4:].isdigit() or int(tok[4:]) <= 0:
                raise bad("needs a positive channel count, e.g. conv64")
            width = int(tok[4:])
            layers.append(nn.Conv2d(s.c, width, 3, padding=1, bias=False))
            s = _Shape(s.kind, width, s.h, s.w)
        elif tok == "bn":
            if not image:
                raise bad("needs an image activation")
            layers += [nn.BatchNorm2d(s.c), nn.ReLU()]
        elif tok == "relu":
            layers.append(nn.ReLU())
        elif tok == "gbpl":
            if not image:
                raise bad("needs an image activation")
            layers.append(GlobalPool())
            s = _Shape(_Shape.VECTOR, s.c)
        elif tok == "ln":
            if image:
                raise bad("needs a vector or sequence activation")
            layers.append(nn.LayerNorm(s.c))
        elif tok == "layer":
            if s.kind != _Shape.SEQUENCE or transformer is None:
                raise bad("is only valid for the transformer")
            o = transformer
            layers.append(DecoderLayer(o.d, o.heads, o.d_ff, o.gelu))
        elif tok.startswith("fc"):
            if image:
                layers.append(nn.Flatten())
                s = _Shape(_Shape.VECTOR, s.c * s.h * s.w)
            hidden = tok != "fc"
            if hidden and (not tok[2:].isdigit() or int(tok[2:]) <= 0):
                raise bad("needs a positive width, e.g. fc or fc128")
            out = int(tok[2:]) if hidden else classes
            layers.append(nn.Linear(s.c, out))
            if hidden:
                layers.append(nn.ReLU())
            s = _Shape(s.kind, out, s.h, s.w)
        else:
            raise bad("is unknown; known layers: convN, bn, relu, gbpl, ln, "
                      "layer, fc, fcN")
    if s.c != classes or s.kind == _Shape.IMAGE:
        raise ValueError(f"model.head: '{head}' must end in 'fc' (a linear "
                         f"layer to {classes} outputs)")
    return nn.Sequential(*layers)


# ------------------------------------------------------------- networks

class Network(nn.Module):
    """Blocks in order, then (for an early exit) one head.

    It carries what a user needs to feed it (export.pbtxt's fields, as
    attributes that survive TorchScript): `input_shape` (one sample),
    `input_dtype`, `class_names`, `language_model`, and the normalisation
    of training, which forward applies itself: images that were stored as
    bytes are taken scaled to [0, 1] (as torchvision's ToTensor gives them)
    and normalised per channel with `mean` and `std` here.
    """

    input_shape: List[int]
    input_dtype: str
    class_names: List[str]
    language_model: bool
    normalise: bool

    def __init__(self, blocks: List[nn.Module], head: Optional[nn.Module],
                 exp: Optional[Message] = None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head if head is not None else nn.Identity()
        exp = exp if exp is not None else Message()
        self.input_shape = [int(d) for d in exp.all("input_shape")]
        self.input_dtype = str(exp.get("input_dtype", "float32"))
        self.class_names = [str(n) for n in exp.all("class_names")]
        self.language_model = bool(exp.get("language_model", False))
        mean = [float(m) for m in exp.all("mean")]
        std = [float(v) for v in exp.all("std")]
        if len(mean) != len(std):
            raise ValueError("export.pbtxt: mean and std differ in length")
        self.normalise = bool(mean)
        # float64 values rounded to float32, as the C++ side does.
        shape = (len(mean), 1, 1)
        self.register_buffer("mean", torch.tensor(
            mean, dtype=torch.float64).float().reshape(shape))
        self.register_buffer("std", torch.tensor(
            std, dtype=torch.float64).float().reshape(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalise:
            x = (x - self.mean) / self.std
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _partition(model: Message, exp: Message, units: int) -> List[int]:
    counts = [int(c) for c in exp.all("partition")]
    if counts:
        if sum(counts) != units:
            raise ValueError(f"export.pbtxt: partition {counts} covers "
                             f"{sum(counts)} units, the model has {units}")
        return counts
    # plan/partition.cc, ParsePartition.
    partition = str(model.get("partition", "") or "")
    blocks = int(model.get("blocks", 0) or 0)
    if partition == "auto":
        raise ValueError("export.pbtxt: no partition and model.partition "
                         "'auto'")
    if not partition:
        if blocks <= 0 or blocks > units:
            raise ValueError("export.pbtxt: no partition, model.partition "
                             "empty and model.blocks unusable")
        return [(k + 1) * units // blocks - k * units // blocks
                for k in range(blocks)]
    counts, used = [], 0
    for i, p in enumerate(partition.split(",")):
        if p == "rest":
            counts.append(units - used)
            used = units
        else:
            counts.append(int(p))
            used += int(p)
    if used != units or min(counts) <= 0:
        raise ValueError(f"model.partition '{partition}' does not cut "
                         f"{units} units")
    return counts


def _flat(name: str) -> str:
    """services/scripted.cc, ScriptedUnitImpl::Flat: '.' spelled '__'."""
    return name.replace(".", "__")


def _named_tensors(module: nn.Module, prefix: str, scripted: bool
                   ) -> Dict[str, torch.Tensor]:
    out = {}
    for items in (module.named_parameters(), module.named_buffers()):
        for name, t in items:
            if t is None:
                continue
            if scripted:
                # "<unit index in the block>.<name in the unit, flat>"
                index, _, rest = name.partition(".")
                name = f"{index}.{_flat(rest)}"
            out[prefix + name] = t
    return out


def _load_strict(targets: Dict[str, torch.Tensor],
                 weights: Dict[str, torch.Tensor], what: str):
    """Copies every tensor of `weights` into `targets` by name: the two sets
    of names must be equal, and every shape and type."""
    missing = sorted(set(targets) - set(weights))
    unused = sorted(set(weights) - set(targets))
    if missing or unused:
        raise ValueError(
            f"{what}: the weights do not match the rebuilt network: "
            f"{len(missing)} tensors missing from weights.pt "
            f"{missing[:8]}, {len(unused)} in weights.pt unused {unused[:8]}")
    for name, t in targets.items():
        w = weights[name]
        if tuple(w.shape) != tuple(t.shape) or w.dtype != t.dtype:
            raise ValueError(
                f"{what}: {name} is {w.dtype} {list(w.shape)} in weights.pt "
                f"but {t.dtype} {list(t.shape)} in the rebuilt network")
        with torch.no_grad():
            t.copy_(w)


class _Built:
    """The rebuilt blocks and heads of one export."""

    def __init__(self):
        self.blocks: List[nn.Module] = []
        self.heads: Dict[int, nn.Module] = {}
        # Exits whose file interlock export wrote (scripted user heads).
        self.written_by_export: Dict[int, str] = {}
        self.network_by_export: Optional[str] = None
        self.exp: Optional[Message] = None  # export.pbtxt


def _model_family(model: Message) -> str:
    for family in ("resnet", "transformer", "mlp", "scripted", "scale"):
        if model.has(family):
            return family
    raise ValueError("export.pbtxt: the model sets no family")


def _scripted_units(directory: str, exp: Message, model: Message,
                    written: Dict[str, int]):
    """The scripted family's units (trained TorchScript) and their shapes."""
    manifest = model.msg("scripted").msg("model")
    declared = manifest.all("units")
    if not declared:
        raise ValueError("export.pbtxt: model.scripted.model has no units")
    shapes = [_shape_of_dims(u.all("output_shape")) for u in declared]
    network = written.get(-1)
    if network and os.path.isfile(os.path.join(directory, network)):
        net = torch.jit.load(os.path.join(directory, network),
                             map_location="cpu")
        units = [getattr(net, f"part{u}") for u in range(len(declared))]
    else:
        folder = model.msg("scripted").get("path", "")
        units = [torch.jit.load(os.path.join(folder, u.get("file")),
                                map_location="cpu") for u in declared]
    return list(zip(units, shapes)), manifest


def _rebuild(directory: str, exp: Message,
             weights: Dict[str, torch.Tensor]) -> _Built:
    config = exp.msg("config")
    model = config.msg("model")
    family = _model_family(model)
    input_shape = [int(d) for d in exp.all("input_shape")]
    classes = int(exp.get("classes", 0))
    written = {n.get("file"): int(n.get("exit_block", 0))
               for n in exp.all("networks")}
    by_block = {k: f for f, k in written.items()}
    transformer = None
    manifest = None
    scripted = family == "scripted"
    if family == "resnet":
        units = _resnet_units(model.msg("resnet"), input_shape, classes)
    elif family == "transformer":
        transformer = _TransformerOptions(model.msg("transformer"))
        units = _transformer_units(model.msg("transformer"), input_shape,
                                   classes)
    elif family == "mlp":
        units = _mlp_units(model.msg("mlp"), input_shape, classes)
    elif family == "scripted":
        units, manifest = _scripted_units(directory, exp, model, by_block)
    else:
        raise ValueError(f"model.{family}: no TorchScript export for this "
                         "family")
    counts = _partition(model, exp, len(units))
    built = _Built()
    built.exp = exp
    if scripted and by_block.get(-1):
        built.network_by_export = by_block[-1]
    user_heads = {}
    if manifest is not None:
        user_heads = {int(h.get("after_unit", 0)): h
                      for h in manifest.all("heads")}
    targets: Dict[str, torch.Tensor] = {}
    first = 0
    for k, count in enumerate(counts):
        block = nn.Sequential(*[u for u, _ in units[first:first + count]])
        last = first + count - 1
        first += count
        targets.update(_named_tensors(block, f"{k}.block.", scripted))
        built.blocks.append(block)
        if k + 1 == len(counts):
            break
        prefix = f"{k}.head."
        if not any(name.startswith(prefix) for name in weights):
            continue  # no heads (an E2E run)
        if last in user_heads:
            # interlock export wrote this exit; its weights are checked too.
            h = user_heads[last]
            if k in by_block:
                built.written_by_export[k] = by_block[k]
                exit_net = torch.jit.load(
                    os.path.join(directory, by_block[k]), map_location="cpu")
                head = getattr(exit_net, f"part{last + 1}")
            else:
                folder = model.msg("scripted").get("path", "")
                head = torch.jit.load(os.path.join(folder, h.get("file")),
                                      map_location="cpu")
            head = nn.Sequential(head)
            targets.update(_named_tensors(head, prefix, True))
        else:
            head = build_head(str(model.get("head", "") or ""),
                              units[last][1], classes, transformer)
            targets.update(_named_tensors(head, prefix, False))
        built.heads[k] = head
    _load_strict(targets, weights, os.path.join(directory, "weights.pt"))
    return built


def _save(module: nn.Module, path: str):
    module.eval()
    scripted = torch.jit.script(module)
    scripted.eval()
    tmp = path + ".tmp"
    torch.jit.save(scripted, tmp)
    os.replace(tmp, path)


_MARKER = "# Written by interlock.build_networks (python/interlock):\n"


def _export_text(directory: str) -> Tuple[str, str]:
    """export.pbtxt as interlock export wrote it, and what build_networks
    appended (its `networks` entries)."""
    path = os.path.join(directory, EXPORT_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: not found; write it with `interlock export --run OUT "
            f"--to {directory}`")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, tail = text.partition(_MARKER)
    return head, tail


def _record_networks(directory: str, files: Dict[str, int]):
    """Lists the networks this package wrote in export.pbtxt's `networks`,
    after a marker line (a later `interlock export` to DIR drops them)."""
    head, tail = _export_text(directory)
    if not head.endswith("\n"):
        head += "\n"
    lines = "".join(f'networks {{\n  file: "{name}"\n  exit_block: {k}\n}}\n'
                    for name, k in sorted(files.items(), key=lambda i: i[1]))
    text = head + _MARKER + lines
    path = os.path.join(directory, EXPORT_FILE)
    if text == head + _MARKER + tail:
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _load(directory: str) -> _Built:
    # The networks interlock export wrote are the ones before the marker.
    exp = read_pbtxt(_export_text(directory)[0])
    weights_file = os.path.join(directory, exp.get("weights") or "weights.pt")
    weights = torch.load(weights_file, map_location="cpu")
    if not isinstance(weights, dict):
        raise ValueError(f"{weights_file}: not a dict of tensors")
    return _rebuild(directory, exp, weights)


def build_modules(directory: str) -> Dict[int, nn.Module]:
    """The exported networks as PyTorch modules (not scripted), eval mode:
    {-1: the whole network, k: exit k (blocks 0..k, head k)}."""
    built = _load(directory)
    out = {-1: Network(built.blocks, None, built.exp).eval()}
    for k, head in built.heads.items():
        out[k] = Network(built.blocks[:k + 1], head, built.exp).eval()
    return out


def build_networks(directory: str, overwrite: bool = False) -> Dict[int, str]:
    """Writes DIR/network.pt and DIR/exit_<k>.pt for an export.

    Files `interlock export` wrote itself (a scripted model's) are kept. The
    others are written unless an earlier call wrote them for this export
    (listed in export.pbtxt after the marker line; with overwrite, always),
    and listed there. Returns {exit block (-1: the whole network): path} of
    every network of the export.
    """
    built = _load(directory)
    ours = {n.get("file"): int(n.get("exit_block", 0)) for n in
            read_pbtxt(_export_text(directory)[1]).all("networks")}
    result: Dict[int, str] = {}
    wanted = [(-1, "network.pt")] + [(k, f"exit_{k}.pt")
                                     for k in sorted(built.heads)]
    for k, name in wanted:
        path = os.path.join(directory, name)
        result[k] = path
        by_export = built.network_by_export if k == -1 else \
            built.written_by_export.get(k)
        if by_export == name:
            ours.pop(name, None)
            continue
        # A file not listed is stale (DIR was exported to again) or foreign.
        if name in ours and os.path.isfile(path) and not overwrite:
            continue
        if k == -1:
            net = Network(built.blocks, None, built.exp)
        else:
            net = Network(built.blocks[:k + 1], built.heads[k], built.exp)
        _save(net, path)
        ours[name] = k
    _record_networks(directory, ours)
    return result


def load_exit(directory: str, k: Optional[int] = None,
              map_location="cpu") -> torch.jit.ScriptModule:
    """The exported network (k None or -1) or early exit k, loaded in eval
    mode; built first when its file is missing."""
    name = "network.pt" if k is None or k < 0 else f"exit_{k}.pt"
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        files = build_networks(directory)
        if path not in files.values():
            raise FileNotFoundError(
                f"{path}: no such network; this export has "
                f"{sorted(os.path.basename(p) for p in files.values())}")
    module = torch.jit.load(path, map_location=map_location)
    module.eval()
    return module

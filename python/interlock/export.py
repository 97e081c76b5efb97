"""export_model: a user's PyTorch network, as units, to TorchScript files and
a model.pbtxt (interlock.v1.ScriptedModel, protobuf text format) that the C++
side loads and cuts into blocks."""

import dataclasses
import hashlib
import inspect
import os
import re
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

_LOSSES = {"classes": "CLASSES", "tokens": "TOKENS"}
# The C++ side reads float32 activations and int64 token ids, nothing else.
_INPUT_DTYPES = {torch.float32: "float32", torch.int64: "int64"}
_ONE_IN_ONE_OUT = "a unit takes one tensor and returns one tensor"
_SKIP_HINT = ("(a skip connection across a cut is not possible: put both "
              "ends in one unit)")


@dataclasses.dataclass
class ExportResult:
    out_dir: str
    model_pbtxt: str
    spec_pbtxt: str
    unit_files: List[str]
    head_files: Dict[int, str]
    input_shape: List[int]
    input_dtype: str
    output_shapes: List[List[int]]   # per unit, without the batch dim
    methods: List[str]               # per unit: "script" or "trace"
    head_methods: Dict[int, str]
    loss: str
    classes: int
    torch_version: str


def export_model(units: Union[nn.Module, Sequence[nn.Module]],
                 sample_input: torch.Tensor,
                 out_dir: str,
                 heads: Optional[Dict[int, nn.Module]] = None,
                 loss: str = "classes",
                 classes: Optional[int] = None,
                 class_names: Optional[Sequence[str]] = None) -> ExportResult:
    """Checks, scripts and saves `units` (and user `heads`) into `out_dir`.

    Raises ValueError, naming the unit or head, for anything the C++ side
    could not train: a unit must map one tensor to one tensor, keep the batch
    dim, output float32 and pass gradients through; the final output must fit
    `loss`.
    """
    units = _unit_list(units)
    heads = _head_dict(heads, len(units))
    if loss not in _LOSSES:
        raise ValueError(f"loss '{loss}': must be one of {sorted(_LOSSES)}")
    input_dtype = _check_sample(sample_input, loss)
    _check_no_shared_parameters(units, heads)

    labels = [_label("unit", i, u) for i, u in enumerate(units)]
    head_labels = {k: _label("head after unit", k, h)
                   for k, h in heads.items()}
    everything = list(units) + list(heads.values())
    snapshot = _Snapshot(everything)
    try:
        # Tracing and the train-mode check draw random numbers (dropout);
        # the user's RNG stream stays as it was.
        with torch.random.fork_rng(devices=[]):
            compiled, methods, outputs = _compile_chain(units, labels,
                                                        sample_input)
            classes = _check_final(outputs[-1], sample_input, loss, classes)
            head_compiled, head_methods = {}, {}
            for k, h in heads.items():
                head_compiled[k], head_methods[k] = _compile(
                    h, head_labels[k], outputs[k])
                _check_head(head_compiled[k], head_labels[k], outputs[k],
                            sample_input, loss, classes)
            _check_gradients(compiled, labels, sample_input, outputs, loss,
                             classes)
            for k, hm in head_compiled.items():
                _check_head_gradients(hm, head_labels[k], outputs[k], loss,
                                      classes)
    finally:
        # BatchNorm statistics moved in the train-mode passes; the files must
        # hold the initial weights.
        snapshot.restore()

    if class_names is not None:
        class_names = [str(n) for n in class_names]
        if len(class_names) != classes:
            raise ValueError(f"class_names: {len(class_names)} names for "
                             f"{classes} classes")

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    unit_files, unit_sums = [], []
    for i, m in enumerate(compiled):
        name = f"unit_{i:03d}.pt"
        unit_sums.append(_save(m, os.path.join(out_dir, name)))
        unit_files.append(name)
    head_files, head_sums = {}, {}
    for k in sorted(head_compiled):
        name = f"head_after_{k:03d}.pt"
        head_sums[k] = _save(head_compiled[k], os.path.join(out_dir, name))
        head_files[k] = name

    input_shape = list(sample_input.shape[1:])
    output_shapes = [list(y.shape[1:]) for y in outputs]
    lines = [
        "# Written by interlock.export_model: interlock.v1.ScriptedModel.",
        f"torch_version: {_quote(torch.__version__)}",
    ]
    lines += [f"input_shape: {d}" for d in input_shape]
    lines += [f"input_dtype: {_quote(input_dtype)}",
              f"loss: {_LOSSES[loss]}",
              f"classes: {classes}"]
    lines += [f"class_names: {_quote(n)}" for n in class_names or []]
    for i, u in enumerate(units):
        shape = " ".join(f"output_shape: {d}" for d in output_shapes[i])
        lines.append(f"# unit {i}: torch.jit.{methods[i]}")
        lines.append(f"units {{ file: {_quote(unit_files[i])} {shape} "
                     f"sha256: {_quote(unit_sums[i])} "
                     f"name: {_quote(type(u).__name__)} }}")
    for k in sorted(head_files):
        lines.append(f"# head after unit {k}: torch.jit.{head_methods[k]}")
        lines.append(f"heads {{ after_unit: {k} file: {_quote(head_files[k])} "
                     f"sha256: {_quote(head_sums[k])} }}")
    model_pbtxt = os.path.join(out_dir, "model.pbtxt")
    _write(model_pbtxt, "\n".join(lines) + "\n")

    # Pooling heads only make sense on image activations (C, H, W).
    images = any(len(s) == 3 for s in output_shapes[:-1])
    spec = (
        "# Paste into a run config in place of its model { ... }.\n"
        "# `head` builds the auxiliary head of a block that ends after a "
        "unit with\n# no user head (head_after_NNN.pt in model.pbtxt); "
        "user heads take precedence.\n"
        "model {\n"
        f"  scripted {{ path: {_quote(out_dir)} }}\n"
        "  partition: \"\"  # e.g. \"2,2,rest\"\n"
        f"  head: {_quote('gbpl_fc' if images else 'ln_fc')}\n"
        "}\n")
    spec_pbtxt = os.path.join(out_dir, "spec.pbtxt")
    _write(spec_pbtxt, spec)

    return ExportResult(
        out_dir=out_dir, model_pbtxt=model_pbtxt, spec_pbtxt=spec_pbtxt,
        unit_files=unit_files, head_files=head_files, input_shape=input_shape,
        input_dtype=input_dtype, output_shapes=output_shapes, methods=methods,
        head_methods=head_methods, loss=loss, classes=classes,
        torch_version=torch.__version__)


# ---------------------------------------------------------------- arguments


def _unit_list(units) -> List[nn.Module]:
    if isinstance(units, (nn.Sequential, nn.ModuleList)):
        units = list(units.children())
    elif isinstance(units, nn.Module):
        raise ValueError("units: a single module; pass a list of units or an "
                         "nn.Sequential whose children are the units")
    units = list(units)
    if not units:
        raise ValueError("units: empty")
    for i, u in enumerate(units):
        if not isinstance(u, nn.Module):
            raise ValueError(f"unit {i}: {type(u).__name__} is not an "
                             "nn.Module")
    return units


def _head_dict(heads, n_units) -> Dict[int, nn.Module]:
    out = {}
    for k, h in (heads or {}).items():
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"heads: key {k!r} is not a unit index")
        # The last unit's output is the final output; it has no aux head.
        if not 0 <= k < n_units - 1:
            raise ValueError(f"heads: unit index {k} out of range: a head "
                             f"follows one of units 0..{n_units - 2} (the "
                             "last unit is the final head)")
        if not isinstance(h, nn.Module):
            raise ValueError(f"heads[{k}]: {type(h).__name__} is not an "
                             "nn.Module")
        out[k] = h
    return dict(sorted(out.items()))


def _check_sample(x, loss) -> str:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"sample_input: {type(x).__name__}, not a tensor")
    if x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"sample_input: shape {list(x.shape)}; it is a "
                         "batch, batch dim first")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"sample_input: dtype {x.dtype}; use float32 "
                         "(images, vectors) or int64 (token ids)")
    if loss == "tokens" and (x.dtype != torch.int64 or x.dim() != 2):
        raise ValueError(f"sample_input: {x.dtype} of shape {list(x.shape)}; "
                         "loss 'tokens' needs int64 token ids [B, T]")
    return _INPUT_DTYPES[x.dtype]


def _check_no_shared_parameters(units, heads):
    # Each unit is saved to its own file and may train in its own process:
    # a tied weight would silently become two weights.
    owner = {}
    parts = [(_label("unit", i, u), u) for i, u in enumerate(units)]
    parts += [(_label("head after unit", k, h), h) for k, h in heads.items()]
    for label, m in parts:
        for name, p in m.named_parameters():
            key = p.data_ptr()
            if p.numel() == 0:
                continue
            if key in owner and owner[key][0] != label:
                raise ValueError(
                    f"{label}: parameter '{name}' is shared with "
                    f"{owner[key][0]} ('{owner[key][1]}'); tied weights "
                    "across units or heads are not possible (put both users "
                    "in one unit)")
            owner.setdefault(key, (label, name))


def _label(kind, index, module):
    return f"{kind} {index} ({type(module).__name__})"


# ---------------------------------------------------------------- compiling


def _compile_chain(units, labels, x):
    """Scripts (or traces) each unit and runs the chain in eval mode."""
    compiled, methods, outputs = [], [], []
    batch = x.shape[0]
    for u, label in zip(units, labels):
        m, method = _compile(u, label, x)
        y = _run_eval(m, label, x)
        if y.dtype != torch.float32:
            raise ValueError(f"{label}: returns {y.dtype}; activations "
                             "between units must be float32 (gradients "
                             "cross every cut)")
        if y.dim() < 1 or y.shape[0] != batch:
            raise ValueError(f"{label}: returns shape {list(y.shape)} for a "
                             f"batch of {batch}; the batch dim must come "
                             "first and stay")
        compiled.append(m)
        methods.append(method)
        outputs.append(y)
        x = y
    return compiled, methods, outputs


def _compile(module, label, x):
    """torch.jit.script, else torch.jit.trace on x: (module, method)."""
    try:
        m = torch.jit.script(module)
    except Exception as e:  # scripting fails in many ways; trace instead
        script_error = e
    else:
        _check_schema(m, label)
        return m, "script"
    _check_signature(module, label)
    was = [(s, s.training) for s in module.modules()]
    try:
        evaluated = torch.jit.trace(module.eval(), x)
        # Dropout is random in train mode: no check_trace there.
        trained = torch.jit.trace(module.train(), x, check_trace=False)
    except Exception as e:
        raise ValueError(
            f"{label}: neither torch.jit.script ({_first_line(script_error)})"
            f" nor torch.jit.trace ({_first_line(e)}) works") from e
    finally:
        for s, t in was:
            s.training = t
    # A trace freezes the mode it was taken in; both modes are needed.
    if _graph_text(evaluated) != _graph_text(trained):
        raise ValueError(
            f"{label}: torch.jit.script fails ({_first_line(script_error)}) "
            "and a trace cannot stand in: the unit computes differently in "
            "train and eval mode (dropout, batch norm), which a trace "
            "freezes; make it scriptable")
    _check_schema(trained, label)
    return trained, "trace"


def _check_schema(m, label):
    schema = m.forward.schema
    args = schema.arguments[1:]  # [0] is self
    required = [a for a in args if not a.has_default_value()]
    if len(required) != 1:
        raise ValueError(f"{label}: forward takes {len(required)} inputs; "
                         f"{_ONE_IN_ONE_OUT} {_SKIP_HINT}")
    if required[0].type != torch.TensorType.get():
        raise ValueError(f"{label}: forward takes {required[0].type}; "
                         f"{_ONE_IN_ONE_OUT}")
    returns = schema.returns
    if len(returns) != 1 or returns[0].type != torch.TensorType.get():
        what = ", ".join(str(r.type) for r in returns) or "nothing"
        raise ValueError(f"{label}: forward returns {what}; "
                         f"{_ONE_IN_ONE_OUT} {_SKIP_HINT}")


def _check_signature(module, label):
    # Before tracing: a trace of a two-input forward would fail obscurely.
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    kinds = (inspect.Parameter.POSITIONAL_ONLY,
             inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    required = [p for p in params
                if p.kind in kinds and p.default is inspect.Parameter.empty]
    if len(required) != 1:
        raise ValueError(f"{label}: forward takes {len(required)} inputs; "
                         f"{_ONE_IN_ONE_OUT} {_SKIP_HINT}")


def _graph_text(traced):
    # Two traces of one module differ only in these generated names.
    return re.sub(r"___torch_mangle_\d+\.", "", str(traced.inlined_graph))


def _first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _run_eval(m, label, x):
    m.eval()
    try:
        with torch.no_grad():
            y = m(x)
    except Exception as e:
        raise ValueError(
            f"{label}: fails on an input of shape {list(x.shape)} "
            f"({x.dtype}): {_first_line(e)}") from e
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{label}: returns {type(y).__name__}; "
                         f"{_ONE_IN_ONE_OUT} {_SKIP_HINT}")
    return y


# ------------------------------------------------------------------- checks


def _check_final(y, x, loss, classes):
    got = list(y.shape)
    if loss == "classes":
        if y.dim() != 2:
            hint = (" (a language model: loss='tokens')" if y.dim() == 3
                    else "")
            raise ValueError(f"final output: shape {got}; loss 'classes' "
                             f"needs [B, classes]{hint}")
        last = y.shape[1]
    else:
        if y.dim() != 3 or y.shape[:2] != x.shape[:2]:
            raise ValueError(f"final output: shape {got} for input "
                             f"{list(x.shape)}; loss 'tokens' needs "
                             "[B, T, vocab]")
        last = y.shape[2]
    if classes is None:
        classes = int(last)
    elif isinstance(classes, bool) or not isinstance(classes, int):
        raise ValueError(f"classes: {classes!r} is not an int")
    elif classes != last:
        raise ValueError(f"final output: shape {got}, but classes is "
                         f"{classes}")
    if classes < 1:
        raise ValueError(f"classes: {classes}")
    # Next-token targets are the input ids themselves.
    if loss == "tokens" and (x.min() < 0 or x.max() >= classes):
        raise ValueError(f"sample_input: token ids in [{int(x.min())}, "
                         f"{int(x.max())}], outside the vocabulary "
                         f"[0, {classes})")
    return classes


def _expected_head_shape(x, loss, classes):
    if loss == "classes":
        return [x.shape[0], classes], "[B, classes]"
    return [x.shape[0], x.shape[1], classes], "[B, T, classes]"


def _check_head(m, label, h_in, x, loss, classes):
    y = _run_eval(m, label, h_in)
    want, pattern = _expected_head_shape(x, loss, classes)
    if list(y.shape) != want or y.dtype != torch.float32:
        raise ValueError(f"{label}: maps {list(h_in.shape)} to "
                         f"{list(y.shape)} ({y.dtype}); a head must return "
                         f"float32 {pattern} = {want}")


def _targets(y, loss, classes):
    # Any valid targets do: the check is about which tensors get a gradient.
    n = y.shape[0] if loss == "classes" else y.shape[0] * y.shape[1]
    t = torch.arange(n) % classes
    return t if loss == "classes" else t.view(y.shape[0], y.shape[1])


def _loss(y, loss, classes):
    t = _targets(y, loss, classes)
    return F.cross_entropy(y.reshape(-1, classes), t.reshape(-1))


def _check_gradients(compiled, labels, x, eval_outputs, loss, classes):
    """Train mode: every unit's parameters, and every cut, get a gradient."""
    outputs = []
    for m, label, want in zip(compiled, labels, eval_outputs):
        m.train()
        try:
            y = m(x)
        except Exception as e:
            raise ValueError(f"{label}: fails in train mode: "
                             f"{_first_line(e)}") from e
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"{label}: returns {type(y).__name__} in train "
                             f"mode; {_ONE_IN_ONE_OUT}")
        if y.shape != want.shape:
            raise ValueError(f"{label}: returns shape {list(y.shape)} in "
                             f"train mode but {list(want.shape)} in eval "
                             "mode")
        if y.requires_grad:
            y.retain_grad()
        outputs.append(y)
        x = y
    final = outputs[-1]
    if not final.requires_grad:
        raise ValueError(f"{labels[-1]}: its output has no gradient (nothing "
                         "before it has trainable parameters, or it "
                         "detaches)")
    _loss(final, loss, classes).backward()
    # Earliest break first: everything above it starves too.
    for i in range(len(outputs) - 2, -1, -1):
        if outputs[i].requires_grad and outputs[i].grad is None:
            raise ValueError(f"{labels[i + 1]}: passes no gradient to its "
                             "input (does it detach it?); gradients must "
                             "cross every cut")
    for m, label in zip(compiled, labels):
        _check_parameter_grads(m, label, "the final loss")


def _check_head_gradients(m, label, h_in, loss, classes):
    m.train()
    y = m(h_in.detach())
    if not y.requires_grad:
        if any(p.requires_grad for p in m.parameters()):
            raise ValueError(f"{label}: its output has no gradient")
        return
    _loss(y, loss, classes).backward()
    _check_parameter_grads(m, label, "its loss")


def _check_parameter_grads(m, label, source):
    for name, p in m.named_parameters():
        if p.requires_grad and p.grad is None:
            raise ValueError(f"{label}: parameter '{name}' gets no gradient "
                             f"from {source}; remove it or set "
                             "requires_grad=False")


class _Snapshot:
    """Values of parameters and buffers, grads and modes, to put back."""

    def __init__(self, modules):
        self.tensors, self.grads, self.modes = [], [], []
        seen = set()
        for top in modules:
            for s in top.modules():
                self.modes.append((s, s.training))
            for t in list(top.parameters()) + list(top.buffers()):
                if id(t) in seen:
                    continue
                seen.add(id(t))
                self.tensors.append((t, t.detach().clone()))
                if isinstance(t, nn.Parameter):
                    self.grads.append((t, t.grad))
                    t.grad = None

    def restore(self):
        with torch.no_grad():
            for t, v in self.tensors:
                t.copy_(v)
        for t, g in self.grads:
            t.grad = g
        for s, training in self.modes:
            s.training = training


# ------------------------------------------------------------------ writing


def _save(m, path) -> str:
    # Saved in train mode: the C++ side trains it and switches to eval
    # itself. m may be the user's own ScriptModule: its modes are kept.
    was = [(s, s.training) for s in m.modules()]
    m.train()
    torch.jit.save(m, path)
    for s, training in was:
        s.training = training
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _quote(s: str) -> str:
    """A protobuf text-format string literal (bytes outside printable ASCII
    as octal escapes of their UTF-8 encoding)."""
    out = []
    for b in str(s).encode("utf-8"):
        c = chr(b)
        if c == "\\" or c == '"':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append(f"\\{b:03o}")
    return '"' + "".join(out) + '"'

"""Exports a small Fashion-MNIST CNN (5 units, one user head) for Interlock.

    /usr/bin/python3 python/examples/export_small_cnn.py OUT_DIR

Deterministic: the same PyTorch build writes the same files, byte for byte,
every time (weights from torch.manual_seed(0); PYTHONHASHSEED=0 because
TorchScript writes a module's constants in set order).
"""

import os
import sys

import torch
from torch import nn

# Runs from a checkout without PYTHONPATH.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))
from interlock import export_model  # noqa: E402

CLASS_NAMES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal",
               "shirt", "sneaker", "bag", "ankle boot"]


class ChannelNorm(nn.Module):
    """LayerNorm over the channels of an NCHW tensor."""

    def __init__(self, channels):
        super().__init__()
        self.norm = nn.LayerNorm(channels)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class DepthwiseBlock(nn.Module):
    """Depthwise 7x7 conv, LayerNorm, pointwise MLP with GELU, residual.

    The residual stays inside the unit: a skip cannot cross a cut.
    """

    def __init__(self, channels, expand=2):
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = ChannelNorm(channels)
        self.pw1 = nn.Conv2d(channels, channels * expand, 1)
        self.act = nn.GELU()
        self.pw2 = nn.Conv2d(channels * expand, channels, 1)

    def forward(self, x):
        return x + self.pw2(self.act(self.pw1(self.norm(self.dw(x)))))


def small_cnn():
    """The units: 1x28x28 -> 16x14x14 -> 16x14x14 -> 32x7x7 -> 32x7x7 -> 10."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.GELU()),
        DepthwiseBlock(16),
        nn.Sequential(ChannelNorm(16), nn.Conv2d(16, 32, 2, stride=2)),
        DepthwiseBlock(32),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(32),
                      nn.Linear(32, 10)),
    )


def small_cnn_head(channels=16):
    """An auxiliary head for a cut after unit 1: pool, norm, linear."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.LayerNorm(channels), nn.Linear(channels, 10))


def export(out_dir):
    torch.manual_seed(0)
    units = small_cnn()
    heads = {1: small_cnn_head()}
    sample = torch.randn(4, 1, 28, 28)
    return export_model(units, sample, out_dir, heads=heads,
                        class_names=CLASS_NAMES)


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable] + argv, env)
    result = export(argv[1])
    with open(result.spec_pbtxt, encoding="utf-8") as f:
        print(f.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

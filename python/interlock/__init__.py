"""Interlock's Python package: export a PyTorch model for Interlock
(TorchScript units + model.pbtxt), and rebuild a trained run's networks from
`interlock export` (network.pt, exit_<k>.pt)."""

from .export import ExportResult, export_model
from .exported import build_networks, load_exit

__all__ = ["ExportResult", "export_model", "build_networks", "load_exit"]

"""The example models of python/examples/, importable from the tests."""

import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def load_example(name="export_small_cnn"):
    """Imports python/examples/NAME.py as a module."""
    path = os.path.join(_HERE, "..", "examples", name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

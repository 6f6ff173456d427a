"""A STAND-IN for torchvision on the CPU SGLang server (tools/sglang/cpu_path, first on that
server's PYTHONPATH only). It is not torchvision.

Why: SGLang imports torchvision at module level from its multimodal code, even to serve a text
model, and the torchvision on PyPI is a CUDA build whose compiled ops fail to load next to the
CPU torch. Every `torchvision.*` module imports here as an empty stub whose names are
placeholders that raise a clear error when used, so a text model starts and an image model
fails loudly. There is no package metadata, so transformers sees torchvision as absent.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+rlpilot-cpu-standin"
_MESSAGE = ("torchvision is not installed in this SGLang server: rlpilot's CPU build of SGLang "
            "serves text models only (tools/sglang/cpu_path/torchvision is a stand-in)")


class _Unavailable:
    """What every torchvision name is here: usable in annotations, defaults and class bodies,
    an error when called or instantiated."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE)

    def __class_getitem__(cls, item):
        return cls


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(_MESSAGE)


Unavailable = _Placeholder("Unavailable", (), {})


def _module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return Unavailable


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StubFinder())
__getattr__ = _module_getattr

"""Importing SGLang's HiCache code on a CPU-only machine (tests, ``python -m bench.sglang``).

SGLang's config package imports torchvision for multimodal preprocessing; no torchvision build
matches the CPU torch here (PyPI's wheels fail at import: "operator torchvision::nms does not
exist"). When torchvision cannot be imported, a placeholder module answers those imports: names
resolve, nothing is callable. The HiCache controller, host pools and storage backends never use
it. The backend itself (:mod:`hpkv.integrations.sglang.backend`) never installs this: a real SGLang
server has its own torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class _Anything(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Unusable(metaclass=_Anything):
    """What a torchvision name resolves to: importable, attributes resolve (constants in other
    modules' tables), never callable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision is not installed in this test environment")

    def __class_getitem__(cls, item: Any) -> Any:
        return cls


def _attr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Unusable


class _TorchvisionPlaceholder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+placeholder"  # type: ignore[attr-defined]
        m.__getattr__ = _attr  # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _torchvision_usable() -> bool:
    try:
        return importlib.util.find_spec("torchvision") is not None and bool(__import__("torchvision"))
    except Exception:
        return False


def install_torchvision_placeholder() -> bool:
    """Answer torchvision imports with the placeholder when no usable torchvision is installed;
    returns whether it did. Idempotent."""
    if any(isinstance(f, _TorchvisionPlaceholder) for f in sys.meta_path):
        return True
    if _torchvision_usable():
        return False
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _TorchvisionPlaceholder())
    return True

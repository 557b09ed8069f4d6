"""SGLang's own HiCache code (controller, host pools, backend factory) driving hpkv, on CPU torch.

Run in ``.venv-sglang`` (``make test-sglang``). One stand-in, for a package the code under test
never calls: SGLang's config package imports torchvision for multimodal preprocessing, and no
torchvision build matches the CPU torch here (PyPI's wheels fail at import: "operator
torchvision::nms does not exist"). When torchvision cannot be imported, an empty placeholder
module answers those imports; any use of it would fail loudly.
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


if not _torchvision_usable():
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _TorchvisionPlaceholder())

# The hpkv fixtures (shm_dir, storage_dir, the HPKV_* scrub) live in tests/conftest.py, loaded first.

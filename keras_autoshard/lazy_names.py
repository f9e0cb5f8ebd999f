"""Module attributes imported on first use, for the public modules that
name the API (`building`, `distributed`, `types`): importing them imports
neither Keras nor JAX, so the command line and `simulate_devices` can still
set `KERAS_BACKEND` and `XLA_FLAGS` first."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    module_name: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of a module whose `names` are imported,
    on first use, from the module each maps to, then kept on the module.

    Args:
        module_name: The module's `__name__`.
        names: Attribute name -> the module that defines it.

    Returns:
        `(__getattr__, __dir__)`, to assign at the module's top level.

    Example:

    ```python
    NAMES = {"plan": "keras_autoshard.planner.planner"}
    __getattr__, __dir__ = lazy_attributes(__name__, NAMES)
    ```
    """
    module = sys.modules[module_name]

    def __getattr__(name: str) -> Any:
        source = names.get(name)
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(names))

    return __getattr__, __dir__

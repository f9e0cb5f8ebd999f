"""What the `compat` privates' checks share: run a check (an exception
counts as a missing private) and read a dotted attribute of a module.

Example:

```python
from keras_autoshard.compat import checks

checks.failing([("os.sep", lambda: checks.attribute("os", "sep"))])  # []
```
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


def failing(
    named_checks: Iterable[tuple[str, Callable[..., Any]]], *args: Any
) -> list[str]:
    """The names whose check is false or raises.

    Args:
        named_checks: `(readable name, check)` pairs; each check is called
            with `args`.
        *args: Handed to every check.

    Returns:
        The names of the checks that did not hold, in order.
    """
    return [name for name, check in named_checks if not _holds(check, args)]


def attribute(module: str, path: str) -> Any:
    """`module`'s attribute at the dotted `path`, importing the module.

    Args:
        module: An importable module name, e.g. `"jax._src.clusters"`.
        path: Dotted attribute path inside it, e.g. `"ClusterEnv.x"`.

    Returns:
        The attribute (raises `ImportError` or `AttributeError` when gone).
    """
    value = importlib.import_module(module)
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _holds(check: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    try:
        return bool(check(*args))
    except Exception:  # noqa: BLE001 - a check that cannot run: the private is gone
        return False

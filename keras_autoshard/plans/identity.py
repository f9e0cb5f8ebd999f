"""Which plan entry belongs to which model variable.

A plan names a variable by its Keras path. Keras lets two layers of one name
live in different sub-models, so two variables can share a path (KerasHub's
BLIP-2, SmolLM3 and T5 do). Such variables are told apart by their order
among the model's variables: the first keeps key `"<path>#0"`, the next
`"<path>#1"`, and so on; a path held by one variable is its own key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

REPEAT_MARK = "#"


def unique_variables(variables: Iterable) -> list:
    """Variables without repeats (tied weights appear once)."""
    seen: set[int] = set()
    result = []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def variable_keys(variables: Iterable) -> dict[int, str]:
    """The plan key of each variable, by `id(variable)`.

    Args:
        variables: A model's variables in `model.variables` order.

    Returns:
        `id(variable)` → key: the path, or `"<path>#<n>"` when `n` earlier
        variables share the path.

    Example:

    ```python
    keys = variable_keys(model.variables)
    plan.variable(keys[id(model.variables[0])])
    ```
    """
    distinct = unique_variables(variables)
    counts = Counter(v.path for v in distinct)
    seen: Counter = Counter()
    keys = {}
    for variable in distinct:
        if counts[variable.path] == 1:
            keys[id(variable)] = variable.path
        else:
            keys[id(variable)] = repeated_key(variable.path, seen[variable.path])
            seen[variable.path] += 1
    return keys


def repeated_key(path: str, index: int) -> str:
    """The key of the `index`-th variable (from 0) of a repeated path."""
    return f"{path}{REPEAT_MARK}{index}"


def key_path(key: str) -> str:
    """The Keras path a key names (`"a/b#1"` → `"a/b"`)."""
    path, mark, index = key.rpartition(REPEAT_MARK)
    return path if mark and index.isdigit() else key

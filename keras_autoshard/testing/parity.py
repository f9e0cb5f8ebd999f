"""How far a sharded result is from the same result on one device."""

from __future__ import annotations

import numpy as np


def relative_error(actual, expected, scale_floor: float = 0.0) -> float:
    """max |actual - expected| / max(max |expected|, scale_floor).

    `scale_floor` keeps tensors that are analytically zero (the gradient of an
    attention key bias, say) from turning rounding noise into a huge ratio.

    Args:
        actual: The sharded result (array-like).
        expected: The one-device result, same shape.
        scale_floor: The least scale to divide by.

    Returns:
        The relative error (the absolute one where the scale is 0).

    Example:

    ```python
    relative_error([1.0, 2.1], [1.0, 2.0])  # 0.05
    ```
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, scale_floor)
    diff = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
    return diff / scale if scale > 0 else diff

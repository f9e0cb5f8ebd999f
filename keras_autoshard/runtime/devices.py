"""Simulated host devices: set XLA's device count before JAX starts.

This module must not import JAX: its whole job is to run before JAX does.
"""

from __future__ import annotations

import os
import re

from keras_autoshard.compat import jax_private
from keras_autoshard.errors import DeviceSetupError  # noqa: F401

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_FLAG_PATTERN = re.compile(re.escape(_DEVICE_COUNT_FLAG) + r"=(\d+)")


def simulate_devices(count: int = 8) -> int:
    """Make JAX expose `count` CPU devices by setting `XLA_FLAGS`.

    Must run before JAX first uses its devices (JAX reads `XLA_FLAGS` once,
    when its backend starts; importing JAX or Keras does not start it). If
    JAX is already running with at least `count` devices this is a no-op;
    with fewer, it raises, because the count can no longer be changed in
    this process.

    Args:
        count: Number of host (CPU) devices to simulate.

    Returns:
        The device count that the flag now asks for.

    Example:

    ```python
    from keras_autoshard.runtime.devices import simulate_devices
    simulate_devices(8)   # before `import jax` / `import keras`
    import jax
    assert jax.device_count() == 8
    ```
    """
    if count < 1:
        raise ValueError(f"simulate_devices needs count >= 1, got {count}.")
    running = _running_jax_device_count()
    if running is not None:
        if running < count:
            raise DeviceSetupError(
                f"JAX is already initialised with {running} device(s), fewer than "
                f"the {count} asked for. Call simulate_devices({count}) (or pass "
                f"--devices {count} on the command line) before JAX first uses its "
                f"devices, or set XLA_FLAGS={_DEVICE_COUNT_FLAG}={count} in the "
                "environment."
            )
        return running
    os.environ["XLA_FLAGS"] = flags_with_device_count(
        os.environ.get("XLA_FLAGS", ""), count
    )
    return count


def flags_with_device_count(flags: str, count: int) -> str:
    """`flags` (an `XLA_FLAGS` value) asking for `count` host devices: its
    device count replaced, or added; every other flag kept.

    Args:
        flags: An `XLA_FLAGS` value, possibly empty.
        count: The host device count to ask for.

    Returns:
        The new `XLA_FLAGS` value.

    Example:

    ```python
    flags_with_device_count("--xla_dump_to=/tmp/d", 4)
    # '--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=4'
    ```
    """
    if _FLAG_PATTERN.search(flags):
        return _FLAG_PATTERN.sub(f"{_DEVICE_COUNT_FLAG}={count}", flags)
    return f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()


def _running_jax_device_count() -> int | None:
    """Device count of an already started JAX backend, or None if not started."""
    if not jax_private.backends_started():
        return None
    import jax

    return jax.device_count()


def accelerator_memory_budget(reserve_fraction: float = 0.05) -> int | None:
    """Usable memory of one accelerator: the smallest `bytes_limit` of
    `memory_stats()` over the local devices, less `reserve_fraction` (at
    least 1 GiB) for the runtime and the program; `None` on CPU devices
    (simulated ones hold host memory, which has no per-device limit).

    Returns:
        Bytes, or `None`.
    """
    import jax

    devices = jax.local_devices()
    if not devices or devices[0].platform == "cpu":
        return None
    limits = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            limits.append(int(stats["bytes_limit"]))
    if not limits:
        return None
    smallest = min(limits)
    return smallest - max(2**30, int(smallest * reserve_fraction))

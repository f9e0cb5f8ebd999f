"""Every JAX private the package relies on, each behind one named function.

Checked on jax 0.10.2 and jax 0.12.0.1 unless a function says otherwise.
JAX is imported inside the functions, never at import time:
`runtime/devices.py` asks whether JAX's backend has started and must not
start (or import) JAX to find out. `missing_privates()` checks that the
installed JAX still has every private used here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from keras_autoshard.compat.checks import attribute, failing

_XLA_BRIDGE = "jax._src.xla_bridge"


def backends_started() -> bool:
    """Whether JAX's backends (its devices) have been initialised in this
    process. Never imports JAX: `False` when JAX is not imported yet.

    Private: `jax._src.xla_bridge.backends_are_initialized()`; JAX has no
    public way to ask without starting the backends
    (`jax.extend.backend.backends()` starts them).
    If it changes: `simulate_devices` cannot tell that it runs too late, and
    raises `AttributeError` instead of its `DeviceSetupError` advice.
    """
    xla_bridge = sys.modules.get(_XLA_BRIDGE)
    if xla_bridge is None:
        return False
    return bool(xla_bridge.backends_are_initialized())


def distributed_client() -> Any:
    """The client of JAX's coordination service (its key-value store), or
    `None` when `jax.distributed` is not initialised.

    Private: `jax._src.distributed.global_state.client` (its
    `key_value_set` and `blocking_key_value_get`).
    If it changes: processes cannot share the plan process 0 made, so
    `AutoShardDistribution` fails on a multi-process job.
    """
    from jax._src import distributed

    return distributed.global_state.client


def self_detected_cluster(skipped_names: Iterable[str] = ()) -> str | None:
    """The name of the first cluster environment JAX detects by itself
    (e.g. a Cloud TPU pod slice), skipping those needing an opt-in and
    those named in `skipped_names`; `None` when there is none.

    A probe that raises counts as absent (it cannot run on this machine).

    Private: `jax._src.clusters.ClusterEnv._cluster_types` and each
    environment's `name`, `opt_in_only_method` and `is_env_present()`.
    If they change: `keras_autoshard.distributed.initialize()` does not join a cluster
    JAX would detect itself; explicit settings still work.
    """
    from jax._src.clusters import ClusterEnv

    skipped = set(skipped_names)
    for environment in ClusterEnv._cluster_types:
        if environment.opt_in_only_method or environment.name in skipped:
            continue
        try:
            if environment.is_env_present():
                return environment.name
        except Exception:  # a probe that cannot run here is not this cluster
            continue
    return None


def saved_residuals(function: Callable, *args) -> list[tuple[Any, str]]:
    """What JAX's autodiff saves of `function`'s forward pass at `args` for
    the backward pass: `(aval, description)` per residual.

    Private: `jax._src.ad_checkpoint.saved_residuals` (the public
    `jax.ad_checkpoint.print_saved_residuals` only prints the same list).
    If it changes: the memory model keeps every primitive's operands as its
    residuals (a larger, cruder activation estimate), with a debug log line.
    """
    from jax._src.ad_checkpoint import saved_residuals as residuals_of

    return residuals_of(function, *args)


def missing_privates() -> list[str]:
    """The JAX privates above that the installed JAX lacks. Imports JAX.

    Returns:
        One readable name per missing private (empty when all are there).

    Example:

    ```python
    from keras_autoshard.compat import jax_private
    assert jax_private.missing_privates() == []
    ```
    """
    return failing(_CHECKS)


def _cluster_types_readable() -> bool:
    types = attribute("jax._src.clusters", "ClusterEnv._cluster_types")
    return all(
        hasattr(environment, "name")
        and hasattr(environment, "opt_in_only_method")
        and callable(environment.is_env_present)
        for environment in types
    )


_CHECKS: list[tuple[str, Callable[[], bool]]] = [
    (
        f"{_XLA_BRIDGE}.backends_are_initialized",
        lambda: callable(attribute(_XLA_BRIDGE, "backends_are_initialized")),
    ),
    (
        "jax._src.distributed.global_state.client",
        lambda: hasattr(attribute("jax._src.distributed", "global_state"), "client"),
    ),
    (
        "jax._src.clusters.ClusterEnv._cluster_types (name, opt_in_only_method, "
        "is_env_present)",
        _cluster_types_readable,
    ),
    (
        "jax._src.ad_checkpoint.saved_residuals",
        lambda: callable(attribute("jax._src.ad_checkpoint", "saved_residuals")),
    ),
]

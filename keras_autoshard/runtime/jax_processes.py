"""JAX's multi-process engine: start it, and what each process owns of a batch.

Everything here uses `jax.distributed` (coordination service, gloo CPU
collectives) as it is; the library adds only the checks and the bookkeeping
of which rows of a global batch a process must load.
"""

from __future__ import annotations

import hashlib
import logging
import math

import jax
import numpy as np

from keras_autoshard.compat import jax_private, keras_private
from keras_autoshard.errors import ClusterError
from keras_autoshard.plans.mesh import SpecEntry, entry_axes
from keras_autoshard.runtime.cluster_spec import ClusterSpec

logger = logging.getLogger(__name__)

_PLAN_KEY_PREFIX = "keras_autoshard/plan/"
_PLAN_WAIT_MS = 600_000


def start_jax_distributed(
    spec: ClusterSpec, heartbeat_timeout_s: int, initialization_timeout_s: int
) -> None:
    """`jax.distributed.initialize` from `spec`, then Keras's shared RNG seed.

    Args:
        spec: The cluster to join; a single process returns at once.
        heartbeat_timeout_s: Seconds before a silent process counts as dead.
        initialization_timeout_s: Seconds to wait for all processes to join.
    """
    if not spec.is_multi_process:
        detected = detected_cluster()
        if detected is None or jax.distributed.is_initialized():
            return
        # A Cloud TPU pod slice (or another environment JAX recognises):
        # JAX reads the coordinator, count and id itself.
        logger.info("Joining the %s cluster JAX detected", detected)
        spec = None

    if spec is not None and jax.distributed.is_initialized():
        if (
            jax.process_count() == spec.num_processes
            and jax.process_index() == spec.process_id
        ):
            return
        raise ClusterError(
            f"jax.distributed is already running as process {jax.process_index()} "
            f"of {jax.process_count()}, not {spec.describe()}."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=spec and spec.coordinator_address,
            num_processes=spec and spec.num_processes,
            process_id=spec and spec.process_id,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            initialization_timeout=initialization_timeout_s,
        )
    except RuntimeError as error:
        where = spec.describe() if spec else "the detected cluster"
        raise ClusterError(
            f"Could not join the JAX cluster as {where}: {error}. "
            "Call keras_autoshard.distributed.initialize() first in the script, "
            "before any JAX array or Keras model is created, on every process."
        ) from error
    keras_private.initialize_rng()
    logger.info(
        "JAX cluster: %d processes, %d devices (%d local)",
        jax.process_count(),
        jax.device_count(),
        jax.local_device_count(),
    )


def detected_cluster() -> str | None:
    """The name of a cluster environment JAX detects itself (e.g. Cloud TPU).

    Only environments JAX detects without opting in count; SLURM, torchrun
    and the explicit variables are read by `keras_autoshard.runtime.cluster` first.
    """
    return jax_private.self_detected_cluster(skipped_names=("slurm",))


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def local_device_count() -> int:
    return jax.local_device_count()


def global_batch_shapes(local_batch, shares: int):
    """Shapes of the global batch whose per-process parts look like `local_batch`.

    Args:
        local_batch: This process's batch (arrays, or a nest of them).
        shares: Per-process parts the global batch is cut into.

    Returns:
        The same nest of `jax.ShapeDtypeStruct`s, first dimension × `shares`.
    """

    def scaled(array):
        shape = tuple(array.shape)
        return jax.ShapeDtypeStruct((shape[0] * shares, *shape[1:]), array.dtype)

    return jax.tree_util.tree_map(scaled, local_batch)


def batch_share(jax_mesh_devices: np.ndarray, axis_names, batch_axis: SpecEntry):
    """How a batch split over `batch_axis` falls onto the processes.

    Args:
        jax_mesh_devices: The mesh's device array (`jax.sharding.Mesh.devices`).
        axis_names: The mesh's axis names.
        batch_axis: The mesh axis (or tuple of axes, the first major) the
            batch is split over (`None`: replicated).

    Returns:
        `(shares, my_share)`: into how many process-owned parts the global
        batch is cut, and which of them (in batch order) this process owns.
    """
    axes = entry_axes(batch_axis)
    if not axes:
        return 1, 0
    # One row of devices per batch position, the batch axes' order major first.
    positions = [list(axis_names).index(axis) for axis in axes]
    moved = np.moveaxis(np.asarray(jax_mesh_devices), positions, range(len(axes)))
    by_batch_index = moved.reshape((-1, math.prod(moved.shape[len(axes) :])))
    owners = []
    for block in by_batch_index:
        processes = frozenset(device.process_index for device in block.flat)
        if not owners or owners[-1] != processes:
            owners.append(processes)
    if len(set(owners)) != len(owners):
        raise ClusterError(
            f"Mesh axis {batch_axis!r} visits the same processes in several "
            "separate blocks, so a process's rows of a batch are not contiguous. "
            "Order the mesh devices process by process."
        )
    mine = [i for i, group in enumerate(owners) if jax.process_index() in group]
    return len(owners), (mine[0] if mine else 0)


def local_batch_rows(global_batch_size: int, jax_mesh, batch_axis: SpecEntry) -> slice:
    """The rows of each global batch this process loads and feeds to Keras.

    Keras's JAX trainer turns every process's batch into one global array
    with `jax.make_array_from_process_local_data`; this is the slice that
    makes the global batch equal to what one process would have seen.

    Args:
        global_batch_size: Rows in one global batch.
        jax_mesh: The `jax.sharding.Mesh` the data is laid out on.
        batch_axis: Mesh axis the batch is split over.

    Returns:
        A slice of `range(global_batch_size)`.
    """
    shares, mine = batch_share(jax_mesh.devices, jax_mesh.axis_names, batch_axis)
    if global_batch_size % shares:
        raise ClusterError(
            f"Global batch {global_batch_size} cannot be cut into {shares} equal "
            f"per-process parts over mesh axis {batch_axis!r}. Use a multiple of "
            f"{shares}."
        )
    rows = global_batch_size // shares
    return slice(mine * rows, (mine + 1) * rows)


def share_text_from_process_0(name: str, text: str | None) -> str:
    """Process 0's `text` on every process (through the coordination service).

    Args:
        name: A key naming what is shared; the same on every process.
        text: The value on process 0 (ignored elsewhere).

    Returns:
        Process 0's text.
    """
    if jax.process_count() == 1:
        return text
    client = jax_private.distributed_client()
    key = _PLAN_KEY_PREFIX + name
    if jax.process_index() == 0:
        client.key_value_set(key, text)
        return text
    return client.blocking_key_value_get(key, _PLAN_WAIT_MS)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]

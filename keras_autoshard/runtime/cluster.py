"""Several processes and hosts: find the cluster, start the backend's engine.

`initialize()` reads where the coordinator is, how many processes there are
and which one this is, from its arguments or from the environment a launcher
sets (Keras's own variables, JAX's, torchrun's, SLURM's), then starts the
backend's own multi-process engine: `jax.distributed.initialize` (through the
same steps as `keras.distribution.initialize`) on JAX, a `torch.distributed`
process group on PyTorch. Nothing here moves data between processes itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping

from keras_autoshard.errors import ClusterError  # noqa: F401
from keras_autoshard.runtime.cluster_spec import ClusterSpec

logger = logging.getLogger(__name__)

DEFAULT_COORDINATOR_PORT = 29500
DEFAULT_HEARTBEAT_TIMEOUT_S = 20
DEFAULT_INITIALIZATION_TIMEOUT_S = 300


def resolve_cluster(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterSpec:
    """Work out the cluster from arguments, else from launcher variables.

    Arguments win. Otherwise the first complete set of variables is used, in
    this order: Keras (`KERAS_DISTRIBUTION_JOB_ADDRESSES`,
    `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID`), JAX
    (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`),
    torchrun (`MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`), SLURM
    (`SLURM_STEP_NODELIST` or `SLURM_JOB_NODELIST`, `SLURM_NTASKS`,
    `SLURM_PROCID`; the coordinator is the first node, on
    `KERAS_AUTOSHARD_COORDINATOR_PORT` or 29500). With none of them this is
    a single process.

    Args:
        coordinator_address: `host:port` of process 0 (or Keras's comma
            separated list of all job addresses, whose first is process 0).
        num_processes: Number of processes.
        process_id: This process's index.
        environ: Variables to read; defaults to `os.environ`.

    Returns:
        The `ClusterSpec`.

    Raises:
        ClusterError: a partial set of arguments or variables, or values that
            contradict each other.

    Example:

    ```python
    spec = resolve_cluster(environ={"SLURM_STEP_NODELIST": "gpu[017-020]",
                                    "SLURM_NTASKS": "4", "SLURM_PROCID": "1"})
    assert spec.coordinator_address == "gpu017:29500"
    ```
    """
    environ = os.environ if environ is None else environ
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if any(value is not None for value in given.values()):
        missing = [name for name, value in given.items() if value is None]
        if missing and not (num_processes == 1 and missing == ["coordinator_address"]):
            raise ClusterError(
                f"initialize() was given {sorted(set(given) - set(missing))} but "
                f"not {missing}. Pass all three (coordinator_address='host:port', "
                "num_processes=N, process_id=I), or none and let the launcher's "
                "environment variables say them."
            )
        return _checked(coordinator_address, num_processes, process_id, "arguments")
    for source, reader in _ENVIRONMENT_READERS:
        found = reader(environ)
        if found is not None:
            return _checked(*found, source)
    return ClusterSpec(None, 1, 0, "single process")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    initialization_timeout_s: int = DEFAULT_INITIALIZATION_TIMEOUT_S,
) -> ClusterSpec:
    """Join a multi-process job on the current Keras backend's own engine.

    Call it once, first thing in the script, on every process (before any
    model or array is created). On JAX it starts `jax.distributed` (CPU
    collectives over gloo) and seeds Keras's random generator identically on
    every process, as `keras.distribution.initialize` does; afterwards
    `keras.distribution.list_devices()` lists the devices of all processes
    and a mesh over them spans hosts. A process that dies makes the others
    stop with an error after `heartbeat_timeout_s` instead of hanging. On
    PyTorch it starts the default `torch.distributed` process group (NCCL on
    GPUs, gloo on CPU) from the same values. A single process is a no-op.

    Args:
        coordinator_address: `host:port` of process 0, or `None` to read it
            (with the two others) from the environment; see `resolve_cluster`.
        num_processes: Number of processes.
        process_id: This process's index.
        heartbeat_timeout_s: Seconds without a heartbeat after which a
            process counts as dead and the job stops (JAX).
        initialization_timeout_s: Seconds to wait for every process to join.

    Returns:
        The `ClusterSpec` joined.

    Example:

    ```python
    # On every host (or under srun / torchrun, with no arguments at all):
    keras_autoshard.distributed.initialize(
        "10.0.0.1:1234", num_processes=2, process_id=0
    )
    dist = keras_autoshard.AutoShardDistribution()
    with dist.scope():
        model = build_model()
    ```
    """
    import keras

    spec = resolve_cluster(coordinator_address, num_processes, process_id)
    backend = keras.backend.backend()
    if backend == "jax":
        from keras_autoshard.runtime.jax_processes import start_jax_distributed

        start_jax_distributed(spec, heartbeat_timeout_s, initialization_timeout_s)
    elif backend == "torch":
        if spec.is_multi_process:
            from keras_autoshard.runtime.torch_processes import (
                ensure_process_group,
            )

            _export_torch_variables(spec)
            ensure_process_group(timeout_s=heartbeat_timeout_s * 3)
            spec = _as_torch_spec(spec)
    elif spec.is_multi_process:
        raise ClusterError(
            f"Multi-process jobs need KERAS_BACKEND=jax or torch; this process "
            f"runs {backend!r} ({spec.describe()})."
        )
    logger.info("keras-autoshard cluster: %s", spec.describe())
    return spec


def process_batch_rows(global_batch_size: int, distribution=None) -> slice:
    """The rows of every global batch that this process should load.

    In a multi-process job each process feeds Keras only its part of a batch
    (Keras assembles the global batch from the parts); this is that part for
    the distribution's mesh, so the job trains on exactly the batches one
    process would. On a single process it is every row.

    Args:
        global_batch_size: Rows in one global batch.
        distribution: The distribution the model trains under; defaults to
            the active one. On the PyTorch backend: the `TensorParallel`
            model (or sharded model) the rows are for.

    Returns:
        A slice of `range(global_batch_size)`.

    Example:

    ```python
    rows = keras_autoshard.distributed.process_batch_rows(64, dist)
    local_x = np.concatenate([x[i : i + 64][rows] for i in range(0, len(x), 64)])
    model.fit(local_x, local_y, batch_size=rows.stop - rows.start, shuffle=False)
    ```
    """
    import keras

    from keras_autoshard.plans.mesh import DATA_AXIS_NAMES

    if keras.backend.backend() == "torch":
        return _torch_batch_rows(global_batch_size, distribution)
    distribution = distribution or keras.distribution.distribution()
    if distribution is None:
        return slice(0, global_batch_size)
    from keras_autoshard.runtime.jax_processes import local_batch_rows

    device_mesh = distribution.device_mesh
    batch_axis = distribution.batch_dim_name or next(
        (name for name in device_mesh.axis_names if name in DATA_AXIS_NAMES), None
    )
    return local_batch_rows(global_batch_size, device_mesh.backend_mesh, batch_axis)


def _torch_batch_rows(global_batch_size: int, sharded_model) -> slice:
    from keras_autoshard.plans.mesh import DATA_AXIS_NAMES
    from keras_autoshard.runtime.torch_processes import local_batch_rows

    mesh = getattr(sharded_model, "mesh", None)
    if mesh is None and getattr(sharded_model, "_sharding", None) is not None:
        mesh = sharded_model.plan.mesh
    if mesh is None:
        raise ClusterError(
            "On the PyTorch backend, process_batch_rows needs the model the rows "
            "are for: pass the TensorParallel(..., distributed_backend='torch') "
            f"model (or a sharded model) as `distribution`, got {sharded_model!r}."
        )
    batch_axis = next((n for n in mesh.axis_names if n in DATA_AXIS_NAMES), None)
    return local_batch_rows(global_batch_size, mesh, batch_axis)


def first_slurm_host(node_list: str) -> str:
    """The first host of a SLURM node list (`"gpu[017-020,031],cpu1"` → `gpu017`).

    Args:
        node_list: `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST` value.

    Returns:
        The host name SLURM lists first.
    """
    match = re.match(r"([^,\[]+)(?:\[([^\],]+))?", node_list.strip())
    if not match or not match.group(1):
        raise ClusterError(f"Cannot read a host from SLURM node list {node_list!r}.")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split("-")[0]


def _checked(coordinator_address, num_processes, process_id, source) -> ClusterSpec:
    try:
        num_processes, process_id = int(num_processes), int(process_id)
    except (TypeError, ValueError) as error:
        raise ClusterError(
            f"num_processes and process_id must be integers (from {source}): "
            f"got {num_processes!r}, {process_id!r}."
        ) from error
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ClusterError(
            f"process_id {process_id} is not in [0, {num_processes}) (from "
            f"{source}). Give each process a distinct id below num_processes."
        )
    if coordinator_address and "," in coordinator_address:
        addresses = coordinator_address.split(",")
        if len(addresses) != num_processes:
            raise ClusterError(
                f"{len(addresses)} job addresses {addresses} for {num_processes} "
                f"processes (from {source}). List one address per process, "
                "process 0 first."
            )
        coordinator_address = addresses[0]
    if num_processes > 1 and not coordinator_address:
        raise ClusterError(
            f"{num_processes} processes but no coordinator address (from {source})."
        )
    if coordinator_address and ":" not in coordinator_address:
        coordinator_address = f"{coordinator_address}:{DEFAULT_COORDINATOR_PORT}"
    return ClusterSpec(coordinator_address, num_processes, process_id, source)


def _read(environ, address_key, count_key, index_key):
    values = [environ.get(key) for key in (address_key, count_key, index_key)]
    if all(value is None for value in values):
        return None
    if any(value is None for value in values):
        missing = [
            key
            for key, value in zip((address_key, count_key, index_key), values)
            if value is None
        ]
        raise ClusterError(
            f"Environment variables {missing} are missing while the others of "
            f"{[address_key, count_key, index_key]} are set. Set all three or none."
        )
    return tuple(values)


def _from_keras(environ):
    return _read(
        environ,
        "KERAS_DISTRIBUTION_JOB_ADDRESSES",
        "KERAS_DISTRIBUTION_NUM_PROCESSES",
        "KERAS_DISTRIBUTION_PROCESS_ID",
    )


def _from_jax(environ):
    return _read(
        environ, "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
    )


def _from_torchrun(environ):
    if "MASTER_ADDR" not in environ or "WORLD_SIZE" not in environ:
        return None
    # torchrun's own store listens on MASTER_PORT; JAX's coordinator (when
    # torchrun only launches JAX processes) takes the next port.
    port = environ.get("KERAS_AUTOSHARD_COORDINATOR_PORT") or str(
        int(environ.get("MASTER_PORT", DEFAULT_COORDINATOR_PORT)) + 1
    )
    return (
        f"{environ['MASTER_ADDR']}:{port}",
        environ["WORLD_SIZE"],
        environ.get("RANK"),
    )


def _from_slurm(environ):
    node_list = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if node_list is None or "SLURM_NTASKS" not in environ:
        return None
    port = environ.get(
        "KERAS_AUTOSHARD_COORDINATOR_PORT", str(DEFAULT_COORDINATOR_PORT)
    )
    host = first_slurm_host(node_list)
    return (f"{host}:{port}", environ["SLURM_NTASKS"], environ.get("SLURM_PROCID"))


_ENVIRONMENT_READERS = (
    ("keras", _from_keras),
    ("jax", _from_jax),
    ("torchrun", _from_torchrun),
    ("slurm", _from_slurm),
)


def _as_torch_spec(spec: ClusterSpec) -> ClusterSpec:
    """torch's rendezvous is MASTER_ADDR:MASTER_PORT itself (not JAX's port)."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return dataclasses.replace(spec, coordinator_address=address)
    return spec


def _export_torch_variables(spec: ClusterSpec) -> None:
    """torch's `env://` rendezvous reads these; set them from the spec."""
    host, port = spec.coordinator_address.rsplit(":", 1)
    os.environ.setdefault("MASTER_ADDR", host)
    os.environ.setdefault("MASTER_PORT", port)
    os.environ.setdefault("WORLD_SIZE", str(spec.num_processes))
    os.environ.setdefault("RANK", str(spec.process_id))

"""GPU targets: XLA:GPU's description of each GPU profile, for compiling a
plan's program for GPUs on a machine that has none.

Each `*.textproto` here is a `GpuTargetConfigProto` (what XLA:GPU reads off a
device: SM count, shared memory, memory size, ...); its header says whether
it was read from a device or written from the vendor's figures. With JAX's
CUDA plugin installed (`pip install "keras-autoshard[gpu-compile]"`; no CUDA
libraries or driver needed), `gpu_topology` gives devices that `jax.jit(...)
.lower(...).compile()` compiles for, ahead of time.

Example:

```python
topology = gpu_topology("h100-80gb", 256)
mesh = jax.sharding.Mesh(np.array(topology.devices).reshape(32, 8), ("data", "model"))
```
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import pathlib
import re

from keras_autoshard.errors import GpuCompilerMissingError, PlanError
from keras_autoshard.plans.hardware import PROFILES, HardwareProfile, hardware_profile

GPU_COMPILE_EXTRA = "keras-autoshard[gpu-compile]"
# JAX's CUDA plugins: the `gpu-compile` extra installs CUDA 12's; a GPU
# machine's JAX may carry CUDA 13's. Either compiles for these targets.
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def target_description(profile: str | HardwareProfile) -> str:
    """The `GpuTargetConfigProto` text of a GPU profile.

    Args:
        profile: A hardware profile or its name (`"h100-80gb"`).

    Returns:
        The description's text.

    Raises:
        PlanError: the profile has no GPU target description (a TPU, or a
            profile of your own without `gpu_target`), naming those that do.
    """
    profile = hardware_profile(profile)
    if profile.gpu_target is None:
        known = sorted(name for name, p in PROFILES.items() if p.gpu_target)
        raise PlanError(
            f"Hardware profile {profile.name!r} has no GPU target description, "
            f"so no XLA:GPU program can be compiled for it; these have one: "
            f"{', '.join(known)}."
        )
    own = pathlib.Path(profile.gpu_target)
    if own.is_absolute():  # a description of your own
        return own.read_text(encoding="utf-8")
    files = importlib.resources.files(__package__)
    return files.joinpath(profile.gpu_target).read_text(encoding="utf-8")


@functools.cache
def device_memory_size(profile: str | HardwareProfile) -> int | None:
    """The device memory XLA:GPU reads from a GPU profile's target
    description (`device_memory_size`), or `None` for a profile without one.

    Args:
        profile: A hardware profile or its name.

    Returns:
        Bytes of one device's memory, as the device reports them.

    Example:

    ```python
    device_memory_size("h100-80gb")  # 85,520,809,984: 81,559 MiB
    ```
    """
    profile = hardware_profile(profile)
    if profile.gpu_target is None:
        return None
    text = target_description(profile)
    match = re.search(r"^\s*device_memory_size:\s*(\d+)", text, re.M)
    if match is None:
        raise PlanError(
            f"The target description {profile.gpu_target} of hardware profile "
            f"{profile.name!r} states no device_memory_size."
        )
    return int(match.group(1))


def require_gpu_compiler() -> None:
    """Raise unless JAX's CUDA plugin (XLA:GPU) is installed.

    Raises:
        GpuCompilerMissingError: naming the extra that installs it.
    """
    if not any(_installed(name) for name in CUDA_PLUGINS):
        raise GpuCompilerMissingError(
            "Compiling for a GPU target needs XLA:GPU, JAX's CUDA plugin, which "
            f'is not installed: pip install "{GPU_COMPILE_EXTRA}" (the plugin '
            "and ptxas, about 1 GB; no GPU, driver or CUDA libraries needed). "
            "Run with JAX_PLATFORMS=cpu on a machine without a GPU."
        )


def gpu_topology(profile: str | HardwareProfile, device_count: int):
    """`device_count` GPUs of a profile, as a JAX topology to compile for.

    Args:
        profile: A GPU hardware profile or its name.
        device_count: How many GPUs (one host's worth or many: XLA compiles
            the per-device program either way).

    Returns:
        A `jax.experimental.topologies` topology; `.devices` are the devices
        a `jax.sharding.Mesh` takes.

    Raises:
        GpuCompilerMissingError: JAX's CUDA plugin is not installed.
        PlanError: the profile has no target description.
    """
    text = target_description(profile)
    require_gpu_compiler()
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        platform="cuda", target_config=text, topology=f"1x1x{device_count}"
    )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package (`jax_plugins`) is not there
        return False

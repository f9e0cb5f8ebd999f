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

import importlib.resources
import importlib.util

from keras_autoshard.errors import GpuCompilerMissingError, PlanError
from keras_autoshard.plans.hardware import PROFILES, HardwareProfile, hardware_profile

GPU_COMPILE_EXTRA = "keras-autoshard[gpu-compile]"


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
    files = importlib.resources.files(__package__)
    return files.joinpath(profile.gpu_target).read_text(encoding="utf-8")


def require_gpu_compiler() -> None:
    """Raise unless JAX's CUDA plugin (XLA:GPU) is installed.

    Raises:
        GpuCompilerMissingError: naming the extra that installs it.
    """
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
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

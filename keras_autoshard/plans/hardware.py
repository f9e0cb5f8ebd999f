"""Hardware profiles: what one device holds and how fast it computes and talks.

A profile names the memory of one device, its peak bfloat16 FLOP/s, and
the bandwidth one device has to its peers within a node (NVLink) or slice
(TPU ICI) and across nodes or slices (InfiniBand, data-centre network), per
direction. The figures are the vendors' published ones; the usable memory
is the device's memory minus a reserve for the runtime, the compiled
program and fragmentation (`RESERVE_FRACTION`, at least `MIN_RESERVE`).

Example:

```python
profile = hardware_profile("h100-80gb")
profile.memory_budget_bytes   # 76 GiB: 80 GiB less the 5 % reserve
```
"""

from __future__ import annotations

import dataclasses

from keras_autoshard.errors import PlanError
from keras_autoshard.plans.mesh import entry_axes

GiB = 2**30
GB = 10**9
RESERVE_FRACTION = 0.05
MIN_RESERVE = 1 * GiB


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator model.

    Args:
        name: The profile's name (`--hardware NAME`).
        platform: `"gpu"` or `"tpu"`.
        memory_bytes: Memory of one device.
        peak_bf16_flops: Peak dense bfloat16 FLOP/s of one device.
        intra_node_bytes_per_s: Bandwidth per device and direction to the
            devices of its node or slice.
        inter_node_bytes_per_s: Bandwidth per device and direction to
            devices of other nodes or slices.
        devices_per_node: Devices in one node (GPUs) or one slice (TPUs).
        source: Where the figures come from.
        gpu_target: For a GPU, the file in `keras_autoshard/runtime/gpu_targets/`
            that describes it to XLA:GPU (a `GpuTargetConfigProto`), or the
            absolute path of a description of your own, so plans compile
            for it without a device (`keras-autoshard inspect --target
            NAME`) and estimates know XLA:GPU's own memory limit
            (`PlanEstimate.compiler_limit_bytes`); `None` if none.

    Example:

    ```python
    mine = HardwareProfile("l4-24gb", "gpu", 24 * 2**30, 121e12, 32e9, 12.5e9, 8)
    plan(build, mesh, x, hardware=mine)
    ```
    """

    name: str
    platform: str
    memory_bytes: int
    peak_bf16_flops: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    devices_per_node: int
    source: str = ""
    gpu_target: str | None = None

    @property
    def reserve_bytes(self) -> int:
        """Memory kept back for the runtime and the program."""
        return max(MIN_RESERVE, int(self.memory_bytes * RESERVE_FRACTION))

    @property
    def memory_budget_bytes(self) -> int:
        """What a plan may use per device: memory less the reserve."""
        return self.memory_bytes - self.reserve_bytes


PROFILES = {
    profile.name: profile
    for profile in (
        HardwareProfile(
            "h100-80gb",
            "gpu",
            80 * GiB,
            989e12,
            450 * GB,
            50 * GB,
            8,
            "NVIDIA H100 SXM: 80 GB HBM3, 989 TFLOP/s dense BF16, NVLink 900 "
            "GB/s (both directions), one 400 Gb/s InfiniBand NIC per GPU",
            "nvidia_h100_80gb.textproto",
        ),
        HardwareProfile(
            "h200",
            "gpu",
            150_109_880_320,
            989e12,
            450 * GB,
            50 * GB,
            8,
            "NVIDIA H200 SXM: 141 GB HBM3e (150,109,880,320 bytes as the device "
            "reports them), 989 TFLOP/s dense BF16, NVLink 900 GB/s (both "
            "directions), one 400 Gb/s InfiniBand NIC per GPU",
            "nvidia_h200.textproto",
        ),
        HardwareProfile(
            "a100-40gb",
            "gpu",
            40 * GiB,
            312e12,
            300 * GB,
            25 * GB,
            8,
            "NVIDIA A100 SXM 40 GB: 312 TFLOP/s dense BF16, NVLink 600 GB/s "
            "(both directions), one 200 Gb/s InfiniBand NIC per GPU",
            "nvidia_a100_40gb.textproto",
        ),
        HardwareProfile(
            "a100-80gb",
            "gpu",
            80 * GiB,
            312e12,
            300 * GB,
            25 * GB,
            8,
            "NVIDIA A100 SXM 80 GB: as A100-40GB with 80 GB HBM2e",
            "nvidia_a100_80gb.textproto",
        ),
        HardwareProfile(
            "tpu-v5e",
            "tpu",
            16 * GiB,
            197e12,
            200 * GB,
            25 * GB,
            256,
            "Google Cloud TPU v5e: 16 GB HBM2, 197 TFLOP/s BF16, ICI 1,600 "
            "Gb/s per chip, slices of up to 256 chips",
        ),
        HardwareProfile(
            "tpu-v5p",
            "tpu",
            95 * GiB,
            459e12,
            600 * GB,
            25 * GB,
            8960,
            "Google Cloud TPU v5p: 95 GB HBM2e, 459 TFLOP/s BF16, ICI 4,800 "
            "Gb/s per chip, pods of up to 8,960 chips",
        ),
    )
}


def hardware_profile(name_or_profile: str | HardwareProfile) -> HardwareProfile:
    """The profile of that name (case-insensitive), or the profile given.

    Args:
        name_or_profile: A name from `PROFILES` (`"h100-80gb"`, ...) or a
            `HardwareProfile`.

    Returns:
        The `HardwareProfile`.

    Raises:
        PlanError: an unknown name, listing the known ones.

    Example:

    ```python
    hardware_profile("H100-80GB").memory_budget_bytes  # 76 GiB
    ```
    """
    if isinstance(name_or_profile, HardwareProfile):
        return name_or_profile
    profile = PROFILES.get(str(name_or_profile).lower())
    if profile is None:
        raise PlanError(
            f"Unknown hardware profile {name_or_profile!r}; known: "
            f"{', '.join(sorted(PROFILES))}. Or pass memory_budget= (bytes or "
            "'80GiB') for another device."
        )
    return profile


def axis_bandwidths(
    profile: HardwareProfile, axis_names: tuple[str, ...], shape: tuple[int, ...]
) -> dict[str, float]:
    """Bytes per second per device along each mesh axis.

    Devices fill a node from the last mesh axis inwards (as
    `jax.experimental.mesh_utils` and torchrun number them), so an axis is
    within a node while the product of its size and the sizes after it fits
    in one node; the others cross nodes.
    """
    bandwidths = {}
    inner = 1
    for name, size in reversed(list(zip(axis_names, shape))):
        inner *= size
        within = inner <= profile.devices_per_node
        bandwidths[name] = (
            profile.intra_node_bytes_per_s if within else profile.inter_node_bytes_per_s
        )
    return bandwidths


def step_time_s(
    profile: HardwareProfile,
    compute_flops: float,
    communication_by_axis: dict[str, float],
    axis_names: tuple[str, ...],
    shape: tuple[int, ...],
) -> float:
    """Compute at the profile's peak FLOP/s plus each axis's communication
    at its bandwidth (no overlap: an upper bound of the step time)."""
    bandwidths = axis_bandwidths(profile, axis_names, shape)
    # A collective over several axes at once (`"batch+model"`) runs at the
    # slowest of them.
    moving = sum(
        bytes_ / min(bandwidths[name] for name in entry_axes(axis))
        for axis, bytes_ in communication_by_axis.items()
    )
    return compute_flops / profile.peak_bf16_flops + moving

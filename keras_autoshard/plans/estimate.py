"""`PlanEstimate`: what the planner expects one device to hold and move.

Plain data carried by a `ShardingPlan` (JSON key `"estimate"`), so that a
plan read back from disk still says what it costs. Bytes are per device;
communication is per training step, by mesh axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# The compiler whose program an estimate follows, by device platform.
COMPILERS = {"cpu": "XLA:CPU", "gpu": "XLA:GPU", "tpu": "XLA:TPU"}

# Share of the budget a plan's estimate leaves free for its error against
# the compiled program's peak, per compiler: the worst under-estimate
# measured there. XLA:CPU (scheduled for memory,
# `tests/planner/test_memory_estimate.py`, BENCHMARKS.md "memory truth"):
# estimate / compiled peak 0.86 to 1.14 over the 65 zoo rows, so 14 %.
# XLA:GPU (BENCHMARKS.md "memory truth on XLA:GPU", the zoo compiled for 8
# H100s): the worst is 0.903 (OPT on 2x4 under `mixed_bfloat16`, 13.73
# against 15.21 MiB), so 9.7 % would do. At real widths ("real-size memory
# truth on XLA:GPU", `benchmarks/real_size_gpu.py`) the worst is 0.971
# (Llama-3.1-405B on 64x8, 59.41 against 61.15 GiB), and a plan for a whole
# GPU is bounded lower still by XLA:GPU's own limit
# (`xla_gpu_program_limit`); on an H200 (`benchmarks/device_step.py`, a
# 1.24 B Llama in six runs, two of them accumulating) the estimate is 0.99
# to 1.04 of the measured peak (0.92 accumulating, before the copies of the
# accumulators one device holds through the backward pass were counted).
# Kept at 14 %, XLA:CPU's: the zoo's worst GPU rows sit at the edge of 10 %
# (0.903, and the zoo Llama on 2x4 at 0.904), and a share with no margin
# over the worst row measured lets the next such row compile over its
# budget. No deficit of fixed size is left: the largest, 1.48 MiB (the same
# OPT row), is 0.90 of its program, under the share; 8 MiB per device were
# kept beside it for GPUs while small plans compiled up to 7.69 MiB over
# their estimate, which left plans nothing of the zoo's budgets. XLA:TPU is
# not measured: it takes XLA:GPU's.
HEADROOM = {"XLA:CPU": 0.14, "XLA:GPU": 0.14, "XLA:TPU": 0.14}

# XLA:GPU limits the memory of the programs it compiles (xla/service/gpu/
# gpu_hlo_schedule.cc, `GetSchedulerMemoryLimit`): 80 % of the device's
# memory as its description states it (`device_memory_size`), less the
# program's arguments and outputs (an aliased output counted once), times
# `--xla_gpu_memory_limit_slop_factor` (95 by default). Its memory
# scheduler and `HloRematerialization` (which recomputes values, `.remat`
# in the optimized HLO) keep the temporaries under that limit where they
# can. Read off the compiled programs of BENCHMARKS.md "real-size memory
# truth on XLA:GPU": Llama-2-70B on 16x16 holds 45.00 GiB of temporaries
# under its limit of 46.84 GiB, having recomputed two layers' float32
# attention scores (2 x 2 GiB) that its schedule would otherwise hold.
XLA_GPU_MEMORY_SHARE = 0.8
XLA_GPU_SLOP_FACTOR = 0.95


def xla_gpu_program_limit(device_memory_bytes: int, io_bytes: int) -> int:
    """The peak XLA:GPU keeps a program under: its arguments and outputs
    plus the limit its scheduler and rematerialization give temporaries.

    Args:
        device_memory_bytes: The device's memory as XLA:GPU reads it (the
            target description's `device_memory_size`).
        io_bytes: The program's arguments and outputs per device, an
            aliased (donated) pair counted once.

    Returns:
        Bytes per device.

    Example:

    ```python
    xla_gpu_program_limit(85_520_809_984, 14 * 2**30)  # about 61 GiB
    ```
    """
    room = max(0.0, XLA_GPU_MEMORY_SHARE * device_memory_bytes - io_bytes)
    return int(io_bytes + room * XLA_GPU_SLOP_FACTOR)


def usable_budget(budget: int, compiler: str = "XLA:CPU") -> int:
    """The part of a budget a plan's estimate may fill (`HEADROOM` of the
    compiler kept).

    Args:
        budget: Bytes per device.
        compiler: `"XLA:CPU"`, `"XLA:GPU"` or `"XLA:TPU"`.

    Returns:
        Bytes per device a plan may be estimated to use.

    Example:

    ```python
    usable_budget(80 * 2**30, "XLA:GPU")  # what a plan may fill of 80 GiB
    ```
    """
    return max(0, int(budget * (1 - HEADROOM[compiler])))


_BYTE_FIELDS = (
    "parameter_bytes",
    "gradient_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "data_bytes",
    "transient_bytes",
    "cache_bytes",
)


@dataclasses.dataclass(frozen=True)
class PlanEstimate:
    """The planner's per-device figures for one plan.

    Args:
        parameter_bytes: Variables' local shards.
        gradient_bytes: Gradients of the trainable variables alive at the
            peak (with layers rematerialized, those made before the
            fullest stage of the backward pass; an unread variable has
            none).
        optimizer_bytes: Optimizer slots of the trainable variables.
        activation_bytes: Values the backward pass keeps.
        data_bytes: The step's inputs and targets on one device.
        transient_bytes: Buffers alive only around the peak.
        cache_bytes: The keys and values a generation cache holds
            (`job="generate"`; zero otherwise).
        communication_by_axis: Collective bytes per step, by mesh axis.
        job: `"train"`, `"inference"` (`predict`) or `"generate"` (token
            by token, with a key/value cache).
        budget_bytes: The per-device budget planned for, if any.
        hardware: The hardware profile's name, if one was given.
        compute_flops: FLOPs of one step's contractions on one device.
        step_time_s: Estimated step time under the profile (compute at its
            peak FLOP/s plus communication at each axis's bandwidth, no
            overlap), or `None` without a profile.
        recompute_flops: Of `compute_flops`, those the rematerialized
            layers spend recomputing their forward pass.
        levers: The memory levers chosen, in words.
        compiler: The compiler whose program the byte figures follow:
            `"XLA:CPU"` (simulated devices, and plans without a profile
            on a CPU host), `"XLA:GPU"` or `"XLA:TPU"` (a profile or the
            devices of that platform).
        search: How the exact search ended, in words: `"optimal, N nodes"`,
            or where a budgeted search stopped at its node or time limit,
            the best plan found and its optimality gap (`None`: a plan
            not made by the search, or read from an older file).
        compiler_limit_bytes: For a training step planned for a GPU profile
            with a target description, the peak XLA:GPU keeps the program
            under by itself (`xla_gpu_program_limit`), which a plan that
            fits stays under (`usable_bytes`); `None` otherwise.

    Example:

    ```python
    estimate = plan.estimate
    print(format_bytes(estimate.peak_bytes), estimate.fits)
    ```
    """

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    data_bytes: int
    transient_bytes: int
    cache_bytes: int = 0
    communication_by_axis: Mapping[str, float] = dataclasses.field(default_factory=dict)
    job: str = "train"
    budget_bytes: int | None = None
    hardware: str | None = None
    compute_flops: float = 0.0
    step_time_s: float | None = None
    recompute_flops: float = 0.0
    levers: tuple[str, ...] = ()
    compiler: str = "XLA:CPU"
    search: str | None = None
    compiler_limit_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        """Everything one device holds at once at the peak of the step."""
        return sum(getattr(self, name) for name in _BYTE_FIELDS)

    @property
    def io_bytes(self) -> int:
        """The step's arguments and outputs per device, donated ones once:
        the variables, the optimizer's, and one step's data."""
        return self.parameter_bytes + self.optimizer_bytes + self.data_bytes

    @property
    def communication_bytes(self) -> float:
        """Collective bytes per step over every mesh axis together."""
        return float(sum(self.communication_by_axis.values()))

    @property
    def usable_bytes(self) -> int | None:
        """What the peak may fill (`None` without a budget): the budget less
        the compiler's `HEADROOM` (`usable_budget`), and no more than the
        compiler's own limit (`compiler_limit_bytes`). Over that limit
        XLA:GPU recomputes values and reorders its schedule by itself, so
        its program is no longer the one the estimate and the step time
        follow; under it the plan's own levers (rematerialized layers,
        micro-batches) make the program fit."""
        if self.budget_bytes is None:
            return None
        usable = usable_budget(self.budget_bytes, self.compiler)
        if self.compiler_limit_bytes is not None:
            usable = min(usable, self.compiler_limit_bytes)
        return usable

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the part of the budget plans may fill
        (`usable_bytes`; `None` without a budget)."""
        if self.budget_bytes is None:
            return None
        return self.peak_bytes <= self.usable_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data; `peak_bytes` included for readers of the file."""
        data: dict[str, Any] = {name: int(getattr(self, name)) for name in _BYTE_FIELDS}
        data["peak_bytes"] = int(self.peak_bytes)
        data["communication_by_axis"] = {
            axis: float(value) for axis, value in self.communication_by_axis.items()
        }
        data["job"] = self.job
        data["budget_bytes"] = self.budget_bytes
        data["hardware"] = self.hardware
        data["compute_flops"] = float(self.compute_flops)
        data["step_time_s"] = self.step_time_s
        data["recompute_flops"] = float(self.recompute_flops)
        data["levers"] = list(self.levers)
        data["compiler"] = self.compiler
        data["search"] = self.search
        data["compiler_limit_bytes"] = self.compiler_limit_bytes
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanEstimate:
        """Read `to_dict`'s form (`peak_bytes` is recomputed, not trusted)."""
        return cls(
            **{name: int(data[name]) for name in _BYTE_FIELDS if name != "cache_bytes"},
            # Plans written before the generate job have no cache.
            cache_bytes=int(data.get("cache_bytes", 0)),
            communication_by_axis=dict(data.get("communication_by_axis") or {}),
            job=data.get("job", "train"),
            budget_bytes=data.get("budget_bytes"),
            hardware=data.get("hardware"),
            compute_flops=float(data.get("compute_flops") or 0.0),
            step_time_s=data.get("step_time_s"),
            recompute_flops=float(data.get("recompute_flops") or 0.0),
            levers=tuple(data.get("levers") or ()),
            # Plans written before estimates followed a GPU's compiler.
            compiler=data.get("compiler", "XLA:CPU"),
            search=data.get("search"),
            compiler_limit_bytes=data.get("compiler_limit_bytes"),
        )

    def lines(self) -> list[tuple[str, int]]:
        """(label, bytes) rows for tables, ending with the peak."""
        cache = [("key/value cache", self.cache_bytes)] * (self.job == "generate")
        return [
            ("parameters", self.parameter_bytes),
            ("gradients", self.gradient_bytes),
            ("optimizer state", self.optimizer_bytes),
            ("activations kept for backward", self.activation_bytes),
            ("inputs and targets", self.data_bytes),
            ("transient buffers", self.transient_bytes),
            *cache,
            ("peak per device", self.peak_bytes),
        ]

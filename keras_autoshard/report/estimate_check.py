"""The planner's estimates next to what the compiler made of the plan.

Pure functions over plain data: the planner's per-device estimates (a
mapping of quantity → bytes) and a `CompiledReport`, or a train step
compiled without weights (`check_train_step`). A quantity whose estimate
differs from the compiled figure by more than the tolerance is flagged, so
a cost model that drifts from XLA shows up at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from rich.table import Table

from keras_autoshard.plans.mesh import entry_axes
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.report.compiled_report import CompiledReport, CompiledStep

DEFAULT_TOLERANCE = 0.10
PEAK = "peak per device (train step)"
FORWARD_PEAK = "peak per device (forward step)"


def compiled_io_bytes(memory: Mapping[str, int]) -> int:
    """A compiled step's arguments and outputs, from XLA's memory analysis:
    arguments + outputs − aliased (donated state written in place).

    Args:
        memory: A `CompiledStep.memory` mapping.

    Returns:
        Bytes per device.
    """
    return (
        memory.get("argument_bytes", 0)
        + memory.get("output_bytes", 0)
        - memory.get("alias_bytes", 0)
    )


def compiled_peak_bytes(memory: Mapping[str, int]) -> int:
    """What a compiled step needs at its peak, from XLA's memory analysis:
    arguments + outputs + temporaries − aliased (donated state written in
    place).

    Args:
        memory: A `CompiledStep.memory` mapping.

    Returns:
        Bytes per device.
    """
    return compiled_io_bytes(memory) + memory.get("temp_bytes", 0)


@dataclasses.dataclass(frozen=True)
class EstimateCheck:
    """One quantity, estimated by the planner and read off the compiled step.

    Args:
        quantity: What is compared (`"train-step communication"`, ...).
        estimated_bytes: The planner's estimate, per device.
        compiled_bytes: The compiled program's figure, per device.
        tolerance: Relative difference above which the row is flagged.
    """

    quantity: str
    estimated_bytes: float
    compiled_bytes: float
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def relative_difference(self) -> float:
        """(estimate − compiled) / compiled; 0 when both are 0."""
        if self.compiled_bytes == 0:
            return 0.0 if self.estimated_bytes == 0 else math.inf
        return (self.estimated_bytes - self.compiled_bytes) / self.compiled_bytes

    @property
    def flagged(self) -> bool:
        return abs(self.relative_difference) > self.tolerance

    def to_dict(self) -> dict[str, float | str | bool]:
        """The check as JSON-ready data (an infinite difference as `None`)."""
        difference = self.relative_difference
        return {
            **dataclasses.asdict(self),
            "relative_difference": None if math.isinf(difference) else difference,
            "flagged": self.flagged,
        }


def planner_estimates(cost, estimate=None) -> dict[str, float]:
    """The planner's per-device figures that a compiled step also has.

    Args:
        cost: A `PlanCost` (from `plan_with_cost`).
        estimate: The plan's `PlanEstimate`, for the peak per device.

    Returns:
        Quantity → bytes per device; `"communication over <axis>"` per axis.
        For an inference plan, the parameters and the forward step's peak
        only (a train step is not what it plans for).
    """
    if estimate is not None and estimate.job != "train":
        return {"parameters": cost.parameter_bytes, FORWARD_PEAK: estimate.peak_bytes}
    estimates = {
        "parameters": cost.parameter_bytes,
        "optimizer state": cost.optimizer_bytes,
        "train-step communication": cost.communication_bytes,
    }
    for axis, axis_bytes in cost.communication_by_axis.items():
        estimates[f"communication over {axis}"] = axis_bytes
    if estimate is not None:
        estimates[PEAK] = estimate.peak_bytes
    return estimates


def check_estimates(
    estimates: Mapping[str, float],
    report: CompiledReport,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[EstimateCheck, ...]:
    """Pair each estimate with the compiled figure it predicts.

    Args:
        estimates: Output of `planner_estimates` (unknown keys are skipped).
        report: The compiled-program report of the planned model (its
            forward step, where it has one, checks the forward peak).
        tolerance: Relative difference above which a row is flagged.

    Returns:
        One `EstimateCheck` per estimate that has a compiled counterpart.

    Example:

    ```python
    checks = check_estimates(
        planner_estimates(result.cost, result.plan.estimate), report
    )
    print([c.quantity for c in checks if c.flagged])
    ```
    """
    compiled = {
        "parameters": report.parameter_bytes_per_device,
        "optimizer state": report.optimizer_bytes_per_device,
    }
    if report.forward_step is not None:
        compiled[FORWARD_PEAK] = compiled_peak_bytes(report.forward_step.memory)
    return check_train_step(estimates, report.train_step, compiled, tolerance)


def check_train_step(
    estimates: Mapping[str, float],
    train_step: CompiledStep,
    compiled: Mapping[str, float] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[EstimateCheck, ...]:
    """Pair each estimate with a compiled train step's figure: its peak, its
    communication in total and over each mesh axis, and the figures of
    `compiled` (variable bytes per device, read elsewhere).

    Args:
        estimates: Output of `planner_estimates` (unknown keys are skipped).
        train_step: The compiled train step.
        compiled: Further compiled figures, by the quantity they check.
        tolerance: Relative difference above which a row is flagged.

    Returns:
        One `EstimateCheck` per estimate that has a compiled counterpart.
    """
    figures = {
        "train-step communication": train_step.operand_bytes(),
        PEAK: compiled_peak_bytes(train_step.memory),
        **(compiled or {}),
    }
    checks = []
    for quantity, estimated in estimates.items():
        if quantity.startswith("communication over "):
            axis = quantity.removeprefix("communication over ")
            # An axis spanning several ("batch+model"): collectives over all.
            actual = train_step.operand_bytes(mesh_axes=entry_axes(axis))
        elif quantity in figures:
            actual = figures[quantity]
        else:
            continue
        checks.append(
            EstimateCheck(quantity, float(estimated), float(actual), tolerance)
        )
    return tuple(checks)


def estimate_table(checks: tuple[EstimateCheck, ...]) -> Table:
    """The checks as a `rich.table.Table`, flagged rows marked `DIFFERS`."""
    table = Table(title="Planner estimate vs compiled program (per device)")
    table.add_column("quantity")
    table.add_column("planner estimate", justify="right")
    table.add_column("compiled", justify="right")
    table.add_column("difference", justify="right")
    table.add_column("check")
    for check in checks:
        difference = check.relative_difference
        table.add_row(
            check.quantity,
            format_bytes(check.estimated_bytes),
            format_bytes(check.compiled_bytes),
            _percent(difference),
            f"DIFFERS (>{check.tolerance:.0%})" if check.flagged else "ok",
        )
    return table


def _percent(difference: float) -> str:
    if math.isinf(difference):
        return "n/a"
    if abs(difference) < 0.005:
        return "0%"
    return f"{difference:+.0%}"

"""`CompiledReport`: per-device bytes and collectives of compiled steps.

Plain data filled in by `report/compiled_program.py`: variable shard sizes
are read from the arrays' addressable shards, collectives from the optimized
HLO, memory from XLA's analysis.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from keras_autoshard.plans.sharding_plan import MeshSpec
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.report.hlo.collectives import CollectiveOp, summarize_collectives


@dataclasses.dataclass(frozen=True)
class VariableShards:
    """Where one variable's bytes live.

    Args:
        path: Variable path.
        shape: Global shape.
        dtype: Dtype name.
        spec: The array's partition spec, one entry per dimension.
        bytes_by_device: Bytes held by each device, in mesh device order.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[str | None, ...]
    bytes_by_device: tuple[int, ...]

    @property
    def max_bytes_per_device(self) -> int:
        return max(self.bytes_by_device)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One compiled step function: its collectives and XLA memory analysis.

    Args:
        name: `"train_step"` or `"forward_step"`.
        collectives: Every collective in the optimized HLO.
        memory: XLA memory analysis in bytes per device (argument, output,
            temp, alias, generated code).
        matmuls: Matrix products (`dot` and `convolution` instructions) in
            the optimized HLO: a rematerialized layer's products appear
            twice, once in the forward pass and once recomputed.
        flops: Floating-point operations one device runs, as XLA's cost
            analysis counts them (`None` where the compiler gives none, as
            XLA:GPU compiled without a device).
        hlo_text: The optimized HLO, in schedule order (e.g. for
            `report.hlo.schedules.schedule_peaks`); not in `to_dict`.
    """

    name: str
    collectives: tuple[CollectiveOp, ...]
    memory: dict[str, int]
    matmuls: int = 0
    flops: float | None = None
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)

    def select(
        self, kind: str | None = None, mesh_axes: Sequence[str] | None = None
    ) -> list[CollectiveOp]:
        """Collectives of one kind and/or over exactly these mesh axes."""
        axes = None if mesh_axes is None else tuple(mesh_axes)
        return [
            op
            for op in self.collectives
            if (kind is None or op.kind == kind)
            and (axes is None or op.mesh_axes == axes)
        ]

    def count(self, kind: str | None = None, mesh_axes=None) -> int:
        return len(self.select(kind, mesh_axes))

    def operand_bytes(self, kind: str | None = None, mesh_axes=None) -> int:
        """Per-device operand bytes summed over the selected collectives."""
        return sum(op.operand_bytes for op in self.select(kind, mesh_axes))

    def ring_bytes(self, kind: str | None = None, mesh_axes=None) -> float:
        """Bytes one device sends for the selected collectives under ring
        algorithms (`CollectiveOp.ring_bytes`)."""
        return sum(op.ring_bytes for op in self.select(kind, mesh_axes))

    def to_dict(self) -> dict[str, Any]:
        """The step as JSON-ready data (no HLO), with per-kind summaries."""
        return {
            "name": self.name,
            "memory": dict(self.memory),
            "flops": self.flops,
            "collectives": [op.to_dict() for op in self.collectives],
            "collective_summary": summarize_collectives(self.collectives),
        }


@dataclasses.dataclass(frozen=True)
class CompiledReport:
    """What the compiler made of a model under a distribution.

    Args:
        mesh: The device mesh.
        parameters: Shard sizes of every model variable.
        optimizer_state: Shard sizes of every optimizer variable.
        train_step: The compiled training step.
        forward_step: The compiled forward (predict) step, or None where
            only the train step was compiled
            (`inspect_compiled(..., with_forward_step=False)`).

    Example:

    ```python
    report = keras_autoshard.inspect_compiled(model, dist, (x, y))
    report.parameter_bytes_per_device
    report.train_step.operand_bytes("all-reduce", mesh_axes=("model",))
    print(report.table())
    ```
    """

    mesh: MeshSpec
    parameters: tuple[VariableShards, ...]
    optimizer_state: tuple[VariableShards, ...]
    train_step: CompiledStep
    forward_step: CompiledStep | None

    @property
    def parameter_bytes_per_device(self) -> int:
        """Largest per-device total of model variable bytes."""
        return _max_device_total(self.parameters)

    @property
    def optimizer_bytes_per_device(self) -> int:
        """Largest per-device total of optimizer variable bytes."""
        return _max_device_total(self.optimizer_state)

    @property
    def steps(self) -> tuple[CompiledStep, ...]:
        """The compiled steps: the train step, and the forward step if any."""
        return tuple(s for s in (self.train_step, self.forward_step) if s is not None)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, with per-kind collective summaries."""

        def shards(items):
            return [dataclasses.asdict(v) for v in items]

        return {
            "mesh": {
                "shape": list(self.mesh.shape),
                "axis_names": list(self.mesh.axis_names),
            },
            "parameter_bytes_per_device": self.parameter_bytes_per_device,
            "optimizer_bytes_per_device": self.optimizer_bytes_per_device,
            "parameters": shards(self.parameters),
            "optimizer_state": shards(self.optimizer_state),
            "train_step": self.train_step.to_dict(),
            "forward_step": None
            if self.forward_step is None
            else self.forward_step.to_dict(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict()` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """The report as text tables: bytes per device, collectives, memory."""
        buffer = io.StringIO()
        console = Console(file=buffer, width=160, color_system=None)
        console.print(
            f"Mesh {self.mesh.describe()}: parameters "
            f"{format_bytes(self.parameter_bytes_per_device)}/device, optimizer "
            f"state {format_bytes(self.optimizer_bytes_per_device)}/device"
        )
        for step in self.steps:
            console.print(collective_table(step))
            console.print(memory_line(step))
        return buffer.getvalue()


def _max_device_total(items: Sequence[VariableShards]) -> int:
    if not items:
        return 0
    totals = [sum(col) for col in zip(*(v.bytes_by_device for v in items))]
    return max(totals)


def collective_table(step: CompiledStep) -> Table:
    """A step's collectives per kind and mesh axes: count, operand bytes and
    ring bytes sent per device, and their total."""
    table = Table(title=f"{step.name}: collectives in the optimized HLO")
    table.add_column("kind")
    table.add_column("mesh axes")
    table.add_column("count", justify="right")
    table.add_column("operand bytes/device", justify="right")
    table.add_column("ring bytes sent/device", justify="right")
    for row in summarize_collectives(step.collectives):
        axes = row["mesh_axes"]
        table.add_row(
            row["kind"],
            "?" if axes is None else ",".join(axes),
            str(row["count"]),
            format_bytes(row["operand_bytes"]),
            format_bytes(row["ring_bytes"]),
        )
    table.add_row(
        "total",
        "",
        str(step.count()),
        format_bytes(step.operand_bytes()),
        format_bytes(step.ring_bytes()),
    )
    return table


def memory_line(step: CompiledStep) -> str:
    """XLA's memory analysis of a step, as one line."""
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in step.memory.items())
    return f"{step.name} XLA memory per device: {parts}"

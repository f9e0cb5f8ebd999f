"""Render a `ShardingPlan` as a text table."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from keras_autoshard.plans.mesh import entry_text
from keras_autoshard.plans.units import format_bytes

if TYPE_CHECKING:
    from keras_autoshard.plans.sharding_plan import ShardingPlan


def _spec_text(spec) -> str:
    return "(" + ", ".join(entry_text(entry) for entry in spec) + ")"


def _roles_text(roles) -> str:
    return "(" + ", ".join("?" if r is None else r for r in roles) + ")"


def build_plan_table(plan: ShardingPlan, max_rows: int | None = None) -> Table:
    """A `rich.table.Table` of the plan, one row per variable plus totals."""
    table = Table(
        title=f"Sharding plan on mesh {plan.mesh.describe()}"
        + (f", batch on {entry_text(plan.batch_axis)!r}" if plan.batch_axis else ""),
        show_footer=True,
    )
    total = plan.total_bytes()
    per_device = plan.bytes_per_device()
    table.add_column("variable", footer=f"{len(plan.variables)} variables")
    table.add_column("shape")
    table.add_column("spec", footer="total / per device")
    table.add_column("roles")
    table.add_column("bytes/device", justify="right", footer=format_bytes(per_device))
    table.add_column("total", justify="right", footer=format_bytes(total))
    rows = plan.variables if max_rows is None else plan.variables[:max_rows]
    for v in rows:
        table.add_row(
            v.path,
            "x".join(str(s) for s in v.shape) or "scalar",
            _spec_text(v.spec),
            _roles_text(v.roles),
            format_bytes(v.bytes_per_device(plan.mesh)),
            format_bytes(v.total_bytes),
        )
    if max_rows is not None and len(plan.variables) > max_rows:
        table.add_row(f"... {len(plan.variables) - max_rows} more", "", "", "", "", "")
    return table


def render_plan_table(plan: ShardingPlan, max_rows: int | None = None) -> str:
    """The plan table as plain text, plus activation layouts and notes."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, color_system=None, force_terminal=False)
    console.print(build_plan_table(plan, max_rows=max_rows))
    for a in plan.activations:
        console.print(f"activation {a.path}: {_spec_text(a.spec)}")
    if plan.estimate is not None:
        console.print(estimate_text(plan.estimate), markup=False, highlight=False)
    for note in plan.notes:
        console.print(f"note: {note}")
    return buffer.getvalue()


def estimate_text(estimate) -> str:
    """One line per figure of a `PlanEstimate`, the peak against the budget."""
    lines = [f"estimate per device ({estimate.job} step):"]
    lines += [f"  {label}: {format_bytes(value)}" for label, value in estimate.lines()]
    if estimate.budget_bytes is not None:
        verdict = "fits" if estimate.fits else "DOES NOT FIT"
        lines.append(f"  budget: {format_bytes(estimate.budget_bytes)} ({verdict})")
    return "\n".join(lines)

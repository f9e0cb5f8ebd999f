"""A picture of a `ShardingPlan`: bytes per device by layer, the estimated
peak against the budget, and mesh layouts.

The left panel shows, for every top-level layer, the bytes of its variables
that each device holds next to what an even split over all devices would
give. Below it, when the plan carries an estimate, one bar stacks what a
device holds at the peak (parameters, gradients, optimizer state, kept
activations, data, transients, the key/value cache), with the budget and
the part of it plans may fill drawn as lines. The other panels show, for
each distinct way the plan cuts weights (spec and shape pattern), one
weight as a grid of blocks labelled with the devices that hold each block.
Drawn with matplotlib's Agg canvas (no display needed, no pyplot global
state).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict

from keras_autoshard.plans.estimate import PlanEstimate
from keras_autoshard.plans.mesh import entry_text, spec_axes
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan, VariableSharding
from keras_autoshard.plans.units import format_bytes

MAX_LAYOUT_PANELS = 8
_LAYOUT_COLUMNS = 4


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Bytes of one top-level layer's variables.

    Args:
        layer: The first component of the variables' paths.
        bytes_per_device: What each device holds.
        even_split_bytes: Total bytes divided by the device count.
    """

    layer: str
    bytes_per_device: int
    even_split_bytes: float


def layer_bytes(plan: ShardingPlan) -> list[LayerBytes]:
    """Per top-level layer bytes per device, in plan order.

    Args:
        plan: The plan.

    Returns:
        One `LayerBytes` per layer.
    """
    per_device: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for variable in plan.variables:
        layer = variable.path.split("/")[0]
        per_device[layer] += variable.bytes_per_device(plan.mesh)
        total[layer] += variable.total_bytes
    devices = plan.mesh.device_count
    return [LayerBytes(name, per_device[name], total[name] / devices) for name in total]


def layout_groups(plan: ShardingPlan) -> list[tuple[VariableSharding, int]]:
    """Sharded weights grouped by (spec, rank): one example and the group size."""
    groups: dict[tuple, list[VariableSharding]] = defaultdict(list)
    for variable in plan.variables:
        if any(axis is not None for axis in variable.spec):
            groups[(variable.spec, len(variable.shape))].append(variable)
    ordered = sorted(groups.values(), key=lambda members: -len(members))
    return [(members[0], len(members)) for members in ordered]


def block_devices(
    variable: VariableSharding, mesh: MeshSpec
) -> dict[tuple[int, int], list[int]]:
    """Which devices hold each (row block, column block) of a weight.

    The weight is drawn as a matrix: dimension 0 gives rows, the others
    (flattened) give columns; a vector is one row. Devices are numbered
    row-major over the mesh.

    Args:
        variable: A planned weight.
        mesh: The plan's mesh.

    Returns:
        (row block, column block) → device ids.
    """
    row_dims = variable.spec[:1] if len(variable.spec) > 1 else ()
    row_axes = spec_axes(row_dims)
    column_axes = spec_axes(variable.spec[len(row_dims) :])
    blocks: dict[tuple[int, int], list[int]] = defaultdict(list)
    ranges = [range(size) for size in mesh.shape]
    for device_id, coords in enumerate(itertools.product(*ranges)):
        position = dict(zip(mesh.axis_names, coords))
        row = _block_index(row_axes, position, mesh)
        column = _block_index(column_axes, position, mesh)
        blocks[(row, column)].append(device_id)
    return dict(blocks)


def _block_index(axes, position, mesh: MeshSpec) -> int:
    index = 0
    for axis in axes:
        index = index * mesh.axis_size(axis) + position[axis]
    return index


def save_plan_figure(plan: ShardingPlan, path: str, dpi: int = 110) -> None:
    """Write a PNG picture of the plan.

    Args:
        plan: The plan to draw.
        path: Where to write the PNG.
        dpi: Resolution.

    Example:

    ```python
    save_plan_figure(plan, "plan.png")
    ```
    """
    plan_figure(plan).savefig(path, dpi=dpi, format="png")


def plan_figure(plan: ShardingPlan):
    """The picture `save_plan_figure` writes, as a matplotlib `Figure`.

    Args:
        plan: The plan to draw.

    Returns:
        A `matplotlib.figure.Figure` (its canvas an Agg canvas).

    Example:

    ```python
    plan_figure(plan).savefig("plan.svg")
    ```
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers = layer_bytes(plan)
    groups = layout_groups(plan)[:MAX_LAYOUT_PANELS]
    layout_rows = max(1, math.ceil(len(groups) / _LAYOUT_COLUMNS))
    height = max(3.0, 0.3 * len(layers) + 1.5, 2.6 * layout_rows)
    height += 0.0 if plan.estimate is None else 1.5
    figure = Figure(figsize=(6 + 3 * _LAYOUT_COLUMNS, height))
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(layout_rows, 2 + _LAYOUT_COLUMNS)
    if plan.estimate is None:
        _draw_layer_bytes(figure.add_subplot(grid[:, :2]), layers, plan)
    else:
        left = grid[:, :2].subgridspec(2, 1, height_ratios=(3, 1), hspace=0.9)
        _draw_layer_bytes(figure.add_subplot(left[0]), layers, plan)
        _draw_estimate(figure.add_subplot(left[1]), plan.estimate)
    for index, (variable, count) in enumerate(groups):
        axes = figure.add_subplot(
            grid[index // _LAYOUT_COLUMNS, 2 + index % _LAYOUT_COLUMNS]
        )
        _draw_layout(axes, variable, count, plan.mesh)
    if not groups:
        axes = figure.add_subplot(grid[0, 2:])
        axes.axis("off")
        axes.text(0.5, 0.5, "every weight is replicated", ha="center")
    figure.suptitle(f"Sharding plan on mesh {plan.mesh.describe()}")
    figure.tight_layout()
    return figure


def _draw_layer_bytes(axes, layers: list[LayerBytes], plan: ShardingPlan) -> None:
    largest = max((layer.bytes_per_device for layer in layers), default=1)
    unit_name, unit = next(
        (name, size)
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
        if largest >= size or size == 1
    )
    positions = range(len(layers))
    axes.barh(
        positions,
        [layer.bytes_per_device / unit for layer in layers],
        color="tab:blue",
        label="held per device",
    )
    axes.barh(
        positions,
        [layer.even_split_bytes / unit for layer in layers],
        height=0.3,
        color="tab:orange",
        label=f"even split over {plan.mesh.device_count}",
    )
    axes.set_yticks(list(positions), [layer.layer for layer in layers], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel(f"{unit_name} per device")
    axes.set_title("Variable bytes per device, by layer")
    axes.legend(fontsize=7, loc="lower right")


def estimate_parts(estimate: PlanEstimate) -> list[tuple[str, int]]:
    """What one device holds at the peak, part by part (the parts with any
    bytes, in `PlanEstimate.lines` order; they sum to `peak_bytes`).

    Args:
        estimate: A plan's estimate.

    Returns:
        `(label, bytes)` pairs.
    """
    return [(label, size) for label, size in estimate.lines()[:-1] if size > 0]


def estimate_title(estimate: PlanEstimate) -> str:
    """The estimate panel's title: the peak, and against the budget whether
    it fits (within the part plans may fill) or by how much it is over.

    Args:
        estimate: A plan's estimate.

    Returns:
        One line of text.
    """
    peak = f"Estimated peak per device {format_bytes(estimate.peak_bytes)}"
    if estimate.budget_bytes is None:
        return peak + " (no budget)"
    usable = estimate.usable_bytes
    budget = format_bytes(estimate.budget_bytes)
    if estimate.peak_bytes <= usable:
        return f"{peak}: fits the budget {budget}"
    over = format_bytes(estimate.peak_bytes - usable)
    return f"{peak}: {over} over the part of the budget {budget} plans may fill"


def _draw_estimate(axes, estimate: PlanEstimate) -> None:
    parts = estimate_parts(estimate)
    scale = max([estimate.peak_bytes, estimate.budget_bytes or 0, 1])
    unit_name, unit = next(
        (name, size)
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
        if scale >= size or size == 1
    )
    start = 0.0
    for index, (label, size) in enumerate(parts):
        axes.barh(0, size / unit, left=start, color=f"C{index}", label=label)
        start += size / unit
    if estimate.budget_bytes is not None:
        axes.axvline(estimate.budget_bytes / unit, color="black", label="budget")
        axes.axvline(
            estimate.usable_bytes / unit,
            color="black",
            linestyle="--",
            label="plans fill at most",
        )
    axes.set_yticks([])
    axes.set_xlabel(f"{unit_name} per device")
    axes.set_title(estimate_title(estimate), fontsize=9)
    axes.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_layout(axes, variable: VariableSharding, count: int, mesh: MeshSpec) -> None:
    blocks = block_devices(variable, mesh)
    rows = 1 + max(r for r, _ in blocks)
    columns = 1 + max(c for _, c in blocks)
    colors = itertools.cycle(
        ["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9"]
    )
    for (row, column), devices in sorted(blocks.items()):
        axes.add_patch(
            _rectangle((column, rows - 1 - row), next(colors), edgecolor="black")
        )
        label = ",".join(str(d) for d in devices)
        axes.text(
            column + 0.5,
            rows - 0.5 - row,
            f"dev {label}",
            ha="center",
            va="center",
            fontsize=max(4, 9 - len(devices) - max(0, min(rows, columns) - 2)),
            # Blocks narrower than tall (a kernel cut over its columns)
            # take their label upright, so that side by side they do not
            # run into each other.
            rotation=90 if columns > rows and columns > 2 else 0,
        )
    axes.set_xlim(0, columns)
    axes.set_ylim(0, rows)
    axes.set_xticks([])
    axes.set_yticks([])
    spec = ", ".join(entry_text(entry) for entry in variable.spec)
    shape = "x".join(str(s) for s in variable.shape)
    more = f" (+{count - 1} alike)" if count > 1 else ""
    name = "/".join(variable.path.split("/")[-2:])
    axes.set_title(f"{name}{more}\n{shape} ({spec})", fontsize=7)


def _rectangle(corner, facecolor, edgecolor):
    from matplotlib.patches import Rectangle

    return Rectangle(corner, 1, 1, facecolor=facecolor, edgecolor=edgecolor)

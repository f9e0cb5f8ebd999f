"""Render strategy measurements as the Markdown section of BENCHMARKS.md."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Mapping, Sequence

from benchmarks.measure import AxesKey, CaseResult, Measurement
from benchmarks.models import MODELS, MegatronMinimum
from keras_autoshard import MeshSpec
from keras_autoshard.plans.units import format_bytes
from keras_autoshard.testing.markdown import markdown_table

BASELINE_STRATEGY = "single"
NOT_AVAILABLE = "n/a"

COLUMNS = (
    ("strategy", False),
    ("devices", True),
    ("collectives", True),
    ("collective bytes/device", True),
    ("by mesh axes", False),
    ("÷ Megatron min", True),
    ("params/device", True),
    ("params ÷ ideal", True),
    ("optimizer/device", True),
    ("median step (ms)", True),
    ("÷ single", True),
)

HOW_TO_READ = """\
**How to read.** *Collectives* and *collective bytes/device* count every \
collective (all-reduce, all-gather, ...) in the optimized HLO of one compiled \
training step, and the operand bytes one device sends into them; *by mesh \
axes* splits those bytes by the mesh axes each collective spans \
(`data_parallel` uses its own 8-device mesh, whose single axis is also named \
`batch`). *÷ Megatron min* divides them by the analytic minimum above: per \
transformer layer two all-reduces of the per-device activation \
(b/data)·s·h·4 bytes over the model axis forward and two backward, plus the \
all-reduce over the data axis of the gradients (the per-device parameter \
bytes of the Megatron plan). *params ÷ ideal* is the largest per-device \
parameter bytes divided by (all parameter bytes ÷ 8): 8 means fully \
replicated, 1 perfectly sharded. *optimizer/device* is the Adam state \
(two slots per parameter, plus two scalars). *median step* is the median \
wall time of `train_on_batch` after two warm-up steps, and *÷ single* its \
ratio to the single-device run measured in the same process.

Caveats: bytes and counts are exact for this compiler; timings are not \
representative. On XLA:CPU the backward input-gradient all-reduces of Q, K \
and V are not summed into one: they travel as one all-reduce with three \
operands, three activations per layer where Megatron needs one, and the \
vocabulary-parallel token embedding adds one forward all-reduce that the \
minimum leaves out: for GPT-2's `handwritten` plan, 2 activations per \
layer plus 1 above the minimum. The 8 devices are simulated on this \
machine's few CPU cores, so sharded steps pay for the simulation and \
timings are noisy: use them to spot regressions, not to predict speed-ups \
on accelerators."""


def render_section(
    results: Sequence[CaseResult],
    minima: Mapping[str, MegatronMinimum],
    mesh: MeshSpec,
    timed_steps: int,
    command: str,
) -> str:
    """The whole section: header, one table per model, how to read it.

    Args:
        results: One result per (model, strategy) case.
        minima: Megatron minimum per model name.
        mesh: The mesh the strategies were given.
        timed_steps: Timed steps per case.
        command: The command that regenerates the section.

    Returns:
        Markdown text.
    """
    parts = [render_header(mesh, timed_steps, command)]
    for model_name, minimum in minima.items():
        model_results = [r for r in results if r.model == model_name]
        parts.append(render_model(model_name, model_results, minimum, mesh))
    parts.append(HOW_TO_READ)
    return "\n\n".join(parts) + "\n"


def render_header(mesh: MeshSpec, timed_steps: int, command: str) -> str:
    """Title, date, machine, versions and the command that regenerates it."""
    today = datetime.date.today().isoformat()
    return (
        "## Sharding strategies compared\n\n"
        f"Generated {today} on {machine_description()}; {versions()}. "
        f"{mesh.device_count} simulated host devices, mesh {mesh.describe()}; "
        f"{timed_steps} timed training steps per case. Regenerate with:\n\n"
        f"```\n{command}\n```"
    )


def render_model(
    model_name: str,
    results: Sequence[CaseResult],
    minimum: MegatronMinimum,
    mesh: MeshSpec,
) -> str:
    """A model's sub-heading, its Megatron minimum and its table."""
    baseline = _baseline_seconds(results)
    rows = [_row(result, minimum, mesh.device_count, baseline) for result in results]
    headers = [title for title, _ in COLUMNS]
    right_aligned = [right for _, right in COLUMNS]
    skipped = [
        f"{r.strategy}: {NOT_AVAILABLE}, {r.reason}."
        for r in results
        if not isinstance(r, Measurement)
    ]
    footnotes = "".join(f"\n\n{note}" for note in skipped)
    return (
        f"### {model_name}\n\n"
        f"{MODELS[model_name].description}. Megatron minimum per device per "
        f"step: {format_bytes(minimum.total_bytes)} = activations "
        f"{format_bytes(minimum.activation_bytes)} ({minimum.formula}, model axis) + "
        f"gradients {format_bytes(minimum.gradient_bytes)} (data axis).\n\n"
        + markdown_table(headers, rows, right_aligned)
        + footnotes
    )


def machine_description() -> str:
    """CPU model and count, operating system."""
    return (
        f"{_cpu_model()} ({os.cpu_count()} CPUs), "
        f"{platform.system()} {platform.machine()}"
    )


def versions() -> str:
    """Versions of Python and the libraries that shape the results."""
    import jax
    import jaxlib
    import keras

    parts = [
        f"Python {platform.python_version()}",
        f"jax {jax.__version__}",
        f"jaxlib {jaxlib.__version__}",
        f"keras {keras.version()}",
    ]
    keras_hub = sys.modules.get("keras_hub")
    if keras_hub is not None:
        parts.append(f"keras-hub {keras_hub.__version__}")
    return ", ".join(parts)


def _row(
    result: CaseResult,
    minimum: MegatronMinimum,
    device_count: int,
    baseline_seconds: float | None,
) -> list[str]:
    """One table row; `device_count` spreads the ideal parameter bytes."""
    if not isinstance(result, Measurement):
        return [result.strategy] + [NOT_AVAILABLE] * (len(COLUMNS) - 1)
    ideal_bytes = result.total_parameter_bytes / device_count
    seconds = result.median_step_seconds
    return [
        result.strategy,
        str(result.device_count),
        str(result.collective_count),
        format_bytes(result.collective_bytes),
        _axes_breakdown(result.collective_bytes_by_axes),
        f"{result.collective_bytes / minimum.total_bytes:.2f}",
        format_bytes(result.parameter_bytes_per_device),
        f"{result.parameter_bytes_per_device / ideal_bytes:.2f}",
        format_bytes(result.optimizer_bytes_per_device),
        f"{seconds * 1000:.1f}",
        _ratio_text(seconds, baseline_seconds),
    ]


def _ratio_text(value: float, baseline: float | None) -> str:
    return NOT_AVAILABLE if baseline is None else f"{value / baseline:.2f}"


def _baseline_seconds(results: Sequence[CaseResult]) -> float | None:
    for result in results:
        if result.strategy == BASELINE_STRATEGY and isinstance(result, Measurement):
            return result.median_step_seconds
    return None


def _axes_breakdown(bytes_by_axes: Mapping[AxesKey, int]) -> str:
    if not bytes_by_axes:
        return "—"
    named = {_axes_label(axes): n for axes, n in bytes_by_axes.items()}
    return ", ".join(f"{label} {format_bytes(n)}" for label, n in sorted(named.items()))


def _axes_label(axes: AxesKey) -> str:
    return "?" if axes is None else "+".join(axes)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"

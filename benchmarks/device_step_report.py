"""The `device-step` section of BENCHMARKS.md, from `device_step`'s JSON
(one file per run: a batch size on one GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.device_step import MEASURE_COMMANDS, RENDER_COMMAND


def render(results: Sequence[dict[str, Any]]) -> str:
    """The `device-step` section of `BENCHMARKS.md`.

    Args:
        results: What `measure` wrote, one per run (same device and model).

    Returns:
        Markdown.
    """
    first = results[0]
    versions = ", ".join(f"{name} {v}" for name, v in first["versions"].items())
    config = first["model"]["config"]
    parameters = first.get("on_device", {}).get("parameters", 0)
    lines = [
        "## One training step on a GPU against the plan",
        "",
        f"Device: **{first['gpu']['kind']}** (one GPU); {versions}; hardware "
        f"profile `{first['profile']}`. Model: KerasHub `LlamaBackbone` at "
        f"Llama-3.2-1B's widths ({config['num_layers']} layers, hidden "
        f"{config['hidden_dim']}, FFN {config['intermediate_dim']}, "
        f"{config['num_query_heads']} query / {config['num_key_value_heads']} "
        f"key-value heads, vocabulary {config['vocabulary_size']:,}, tied "
        f"embeddings; {parameters / 1e9:.2f} B parameters), "
        f"`{first['model']['policy']}`, Adam, MSE against the backbone's output, "
        "planned for a 1x1 mesh under the profile on the GPU's machine (`ka.plan`"
        " with the GPU visible, as a user plans there). Step time: the median of "
        f"{first['steps']['timed']} calls of the compiled train step after "
        f"{first['steps']['warmup']} untimed ones, each waiting for its result; "
        "the estimate is compute at the profile's dense BF16 peak (one GPU: no "
        "communication). Peak memory: the device allocator's `peak_bytes_in_use` "
        "after those calls (the whole process: weights, optimizer, batch, the "
        "step's buffers). Each run also plans the same request in a process "
        "with `JAX_PLATFORMS=cpu`, as on a machine without a GPU.",
        "",
        "Regenerate on a machine with one such GPU, then here:",
        "",
        "```",
        *MEASURE_COMMANDS,
        RENDER_COMMAND,
        "```",
        "",
    ]
    for result in results:
        lines += _run_lines(result)
    return "\n".join(lines).rstrip() + "\n"


def _run_lines(result: dict[str, Any]) -> list[str]:
    from keras_autoshard.plans.units import format_bytes
    from keras_autoshard.testing.markdown import markdown_table

    model = result["model"]
    planned_here = "error" not in result["plan"]
    estimate = (result["plan"] if planned_here else result["plan_on_host_cpu"])[
        "estimate"
    ]
    host_plan = result.get("plan_on_host_cpu", {})
    device = result.get("on_device", {})
    tokens = model["batch"] * model["sequence"]
    budget = result.get("budget")
    title = f"### Batch {model['batch']} × {model['sequence']} tokens"
    lines = [
        title + (f", memory budget {budget}" if budget else ""),
        "",
        f"Levers the plan chose: {', '.join(estimate.get('levers') or ['none'])}.",
        "",
    ]
    step_s = device.get("optimizer_step_s")
    estimated_s = estimate.get("step_time_s")
    both = bool(estimated_s and step_s)
    rows = [
        [
            "step time (s)",
            f"{estimated_s:.3f}" if estimated_s else "—",
            f"{step_s:.3f}" if step_s else "—",
            f"{estimated_s / step_s:.2f}" if both else "—",
        ],
        [
            "tokens/s on the GPU",
            f"{tokens / estimated_s:,.0f}" if estimated_s else "—",
            f"{tokens / step_s:,.0f}" if step_s else "—",
            f"{step_s / estimated_s:.2f}" if both else "—",
        ],
    ]
    header = ["", "estimated", "measured on the device", "ratio"]
    lines += [markdown_table(header, rows, [False, True, True, True]), ""]
    estimated_peak = estimate["peak_bytes"]
    where = "planned on the GPU's machine" if planned_here else "planned on its CPU"
    memory_rows = [[f"plan's estimate ({where})", format_bytes(estimated_peak), "1.00"]]
    for label, value in (
        (
            "XLA:GPU compiled deviceless for the profile (`compile_for_target`)",
            result.get("deviceless", {}).get("compiled_peak_bytes"),
        ),
        (
            "XLA:GPU compiled for the device (memory analysis)",
            device.get("compiled_peak_bytes"),
        ),
        (
            "measured on the device (`peak_bytes_in_use`)",
            device.get("peak_bytes_in_use"),
        ),
    ):
        memory_rows.append(
            [
                label,
                "—" if value is None else format_bytes(value),
                "—" if not value else f"{estimated_peak / value:.2f}",
            ]
        )
    header = ["peak per device", "bytes", "estimate / this"]
    lines += [markdown_table(header, memory_rows, [False, True, True]), ""]
    measured_peak = device.get("peak_bytes_in_use")
    if budget and measured_peak:
        budget_bytes = estimate["budget_bytes"]
        verdict = "within it" if measured_peak <= budget_bytes else "OVER it"
        lines.append(
            f"- Asked for a budget of {budget} per device (`memory_budget=`): "
            f"the device's measured peak {format_bytes(measured_peak)} is "
            f"{verdict} ({measured_peak / budget_bytes:.0%} of the budget)."
        )
    flops = estimate.get("compute_flops")
    if flops and step_s:
        rate = flops / step_s
        lines.append(
            f"- The plan counts {flops / 1e12:.1f} TFLOP per step (its "
            "contractions); at the measured step time that is "
            f"{rate / 1e12:.0f} TFLOP/s, {rate / peak_flops(result):.0%} of the "
            "profile's dense BF16 peak, which the estimate assumes."
        )
    if planned_here and "estimate" in host_plan:
        host = host_plan["estimate"]
        lines.append(
            "- Planned with `JAX_PLATFORMS=cpu`, Keras traces XLA's attention, "
            "which keeps the (batch, heads, query, key) probabilities for the "
            "backward pass, not the cuDNN attention the GPU runs (which keeps "
            f"none): that plan estimates {format_bytes(host['peak_bytes'])} for "
            "a program the GPU does not run, with levers: "
            f"{', '.join(host.get('levers') or ['none'])}."
        )
    refused = _plan_error(host_plan.get("error", ""))
    if planned_here and refused:
        lines.append(
            "- Planned with `JAX_PLATFORMS=cpu`, Keras traces XLA's attention, "
            "which keeps the (batch, heads, query, key) probabilities for the "
            "backward pass, not the cuDNN attention the GPU runs (which keeps "
            f"none): no plan fits, as the planner says: {refused}"
        )
    for name in ("plan", "plan_on_host_cpu", "deviceless", "on_device"):
        told = name == "plan_on_host_cpu" and refused
        if "error" in result.get(name, {}) and not told:
            lines.append(f"- {name} failed: `{result[name]['error'][:300]}`")
    if device.get("attention_custom_calls"):
        lines.append(
            "- The device's program calls cuDNN's fused attention ("
            + ", ".join(f"`{call}`" for call in device["attention_custom_calls"])
            + "), as Keras picks it on a GPU."
        )
    return lines + [""]


def _plan_error(error: str) -> str:
    """The planner's own words where a phase failed because no plan fits
    (the child's traceback ends with its `PlanError`), else ''."""
    marker = "PlanError: "
    if marker not in error:
        return ""
    return error[error.rindex(marker) + len(marker) :].strip()


def peak_flops(result: dict[str, Any]) -> float:
    """The dense BF16 FLOP/s of the profile the run was planned for."""
    from keras_autoshard.plans.hardware import hardware_profile

    return hardware_profile(result["profile"]).peak_bf16_flops

"""The `device-step` section of BENCHMARKS.md, from `device_step`'s JSON."""

from __future__ import annotations

from typing import Any

from benchmarks.device_step import COMMAND, RENDER_COMMAND


def render(result: dict[str, Any]) -> str:
    """The `device-step` section of `BENCHMARKS.md` from `measure`'s JSON.

    Args:
        result: What `measure` wrote.

    Returns:
        Markdown.
    """
    from benchmarks.markdown import markdown_table
    from keras_autoshard.plans.plan_table import format_bytes

    versions = ", ".join(f"{name} {v}" for name, v in result["versions"].items())
    model = result["model"]
    config = model["config"]
    planned_here = "error" not in result["plan"]
    plan = result["plan"] if planned_here else result["plan_on_host_cpu"]
    estimate = plan["estimate"]
    host_plan = result.get("plan_on_host_cpu", {})
    deviceless = result.get("deviceless", {})
    device = result.get("on_device", {})
    tokens = model["batch"] * model["sequence"]
    lines = [
        "## One training step on a GPU against the plan",
        "",
        f"Device: **{result['gpu']['kind']}** (one GPU); {versions}; "
        f"hardware profile `{result['profile']}`. Model: KerasHub `LlamaBackbone` "
        f"at Llama-3.2-1B's widths ({config['num_layers']} layers, hidden "
        f"{config['hidden_dim']}, FFN {config['intermediate_dim']}, "
        f"{config['num_query_heads']} query / {config['num_key_value_heads']} "
        f"key-value heads, vocabulary {config['vocabulary_size']:,}, tied "
        f"embeddings; {device.get('parameters', 0) / 1e9:.2f} B parameters), "
        f"`{model['policy']}`, batch {model['batch']} × {model['sequence']} "
        "tokens, Adam, MSE against the backbone's output, planned for a 1x1 "
        f"mesh under the profile (levers: {estimate.get('levers') or 'none'}). "
        f"Step time: the median of {result['steps']['timed']} calls of the "
        f"compiled train step after {result['steps']['warmup']} untimed ones, "
        "each waiting for its result; the estimate is compute at the "
        "profile's dense BF16 peak (one GPU: no communication). Peak memory: "
        "the device allocator's `peak_bytes_in_use` after those calls (the "
        "whole process: weights, optimizer, batch, the step's buffers).",
        "",
        "Regenerate on a machine with one such GPU, then here:",
        "",
        "```",
        COMMAND,
        RENDER_COMMAND,
        "```",
        "",
    ]
    step_s = device.get("optimizer_step_s")
    estimated_s = estimate.get("step_time_s")
    rows = [
        [
            "step time (s)",
            f"{estimated_s:.3f}" if estimated_s else "—",
            f"{step_s:.3f}" if step_s else "—",
            f"{estimated_s / step_s:.2f}" if estimated_s and step_s else "—",
        ],
        [
            "tokens/s on the GPU",
            f"{tokens / estimated_s:,.0f}" if estimated_s else "—",
            f"{tokens / step_s:,.0f}" if step_s else "—",
            f"{step_s / estimated_s:.2f}" if estimated_s and step_s else "—",
        ],
    ]
    lines += [
        markdown_table(["", "estimated", "measured on the device", "ratio"], rows),
        "",
    ]
    estimated_peak = estimate["peak_bytes"]
    where = "planned on the GPU's machine" if planned_here else "planned on its CPU"
    memory_rows = [[f"plan's estimate ({where})", format_bytes(estimated_peak), "1.00"]]
    if planned_here and "estimate" in host_plan:
        host_peak = host_plan["estimate"]["peak_bytes"]
        memory_rows.append(
            [
                "the same request planned with `JAX_PLATFORMS=cpu` (its estimate)",
                format_bytes(host_peak),
                f"{estimated_peak / host_peak:.2f}",
            ]
        )
    for label, value in (
        (
            "XLA:GPU compiled deviceless for the profile (`compile_for_target`)",
            deviceless.get("compiled_peak_bytes"),
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
    lines += [
        markdown_table(["peak per device", "bytes", "estimate / this"], memory_rows),
        "",
    ]
    flops = estimate.get("compute_flops")
    if flops and step_s:
        rate = flops / step_s
        lines.append(
            f"- The plan counts {flops / 1e12:.1f} TFLOP per step (its "
            "contractions); at the measured step time that is "
            f"{rate / 1e12:.0f} TFLOP/s, {rate / estimate_peak_flops(result):.0%} "
            "of the profile's dense BF16 peak, which the estimate assumes."
        )
    if planned_here and "estimate" in host_plan:
        lines.append(
            "- Planned where JAX sees no GPU, Keras traces XLA's attention, "
            "which keeps the (batch, heads, query, key) probabilities for the "
            "backward pass; on the GPU Keras runs cuDNN's fused attention, "
            "which keeps none, so a plan made off the GPU over-counts this "
            "program (its levers: "
            f"{', '.join(host_plan['estimate'].get('levers') or ['none'])})."
        )
    for name in ("plan", "plan_on_host_cpu", "deviceless", "on_device"):
        if "error" in result.get(name, {}):
            lines.append(f"- {name} failed: `{result[name]['error'][:300]}`")
    if device.get("attention_custom_calls"):
        lines.append(
            "- The device's program calls cuDNN's fused attention ("
            + ", ".join(device["attention_custom_calls"])
            + "): Keras picks it on a GPU."
        )
    return "\n".join(lines).rstrip() + "\n"


def estimate_peak_flops(result: dict[str, Any]) -> float:
    """The dense BF16 FLOP/s of the profile the figures were planned for."""
    from keras_autoshard.plans.hardware import hardware_profile

    return hardware_profile(result["profile"]).peak_bf16_flops

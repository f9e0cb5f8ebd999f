"""The GPU benchmarks' sections: the memory truth on XLA:GPU names the rows
outside the bound, and the device-step section is what its committed
results render (`benchmarks/memory_truth_gpu.py`, `device_step.py`,
`device_step_report.py`)."""

import json
import os

from keras_autoshard.testing.markdown import read_section


def _gpu_row(model, mesh, policy, estimated, compiled, collectives, **extra):
    return {
        "model": model, "mesh": mesh, "policy": policy,
        "dtype_policy": policy.split(",")[0], "rematerialize": "auto",
        "budget_share": None, "levers": "none", "compiler": "XLA:GPU",
        "estimated_peak": estimated, "compiled_peak": compiled,
        "collectives_by_axes": collectives, "collectives_by_kind": {},
        "layout": f"{model} {mesh}", **extra,
    }  # fmt: skip


def test_gpu_memory_truth_names_rows_outside_the_bound_and_planner_above_megatron():
    from benchmarks.memory_truth_gpu import render

    zoo_rows = [
        _gpu_row("gpt2", "2x4", "float32", 1000, 1050, {"batch": 100, "model": 300}),
        _gpu_row("llama", "2x4", "float32", 700, 1000, {"batch": 100, "model": 500}),
        _gpu_row("llama", "2x4", "float32, remat all", 1200, 1000, {"model": 1},
                 rematerialize="all"),
        {"model": "llama", "mesh": "2x4", "policy": "float32, budget 70% of the "
         "free peak", "dtype_policy": "float32", "rematerialize": "auto",
         "budget_share": 0.7, "plan_error": "No plan fits the per-device budget "
         "of 7 MiB: the least peak found, on batch=2 x model=4, is 8 MiB, over "
         "by 1.00 MiB (parameters 1 MiB)."},
    ]  # fmt: skip
    megatron_rows = [
        {"model": "gpt2", "mesh": "2x4", "planner_layout": "gpt2 2x4",
         "same_layout": True},
        {"model": "llama", "mesh": "2x4", "planner_layout": "llama 2x4",
         "same_layout": False, "compiled_peak": 900,
         "collectives_by_axes": {"batch": 100, "model": 400},
         "collectives_by_kind": {"reduce-scatter": 10}},
    ]  # fmt: skip
    text = render(zoo_rows, megatron_rows, "python -m x", "this machine", 120)
    assert "3 rows compiled: 0.70 to 1.20 (1 of 3 within ±10%)" in text
    assert "under the compiled peak on 2 of 3 rows." in text
    assert (
        "(ratios before rounding), farthest first: llama 2x4 float32 (0.70); "
        "llama 2x4 float32, remat all (1.20)." in text
    )
    assert "rematerializing 1.20 to 1.20 (0 of 1 within ±10%)" in text
    assert "over by 1.00 MiB." in text and "(parameters" not in text
    assert "| llama | 2x4 | float32, budget 70% of the free peak | no plan |" in text
    assert "at most the hand-written layout's on 1 of 2 rows." in text
    assert "hand-written one on gpt2 2x4." in text
    assert "The planner above the hand-written layout: llama 2x4 (1.20)." in text
    assert "Compiles with reduce-scatters: hand-written llama 2x4." in text
    assert (
        "| llama | 2x4 | no | 100 B | 500 B | 600 B | 100 B | 400 B | 500 B |" in text
    )
    assert "took 2 minutes" in text and "python -m x" in text


def test_gpu_memory_truth_compares_budgeted_plans_compiled_peaks_with_their_budgets():
    from benchmarks.memory_truth_gpu import render

    budgeted = {"budget_share": 0.7, "levers": "remat 2 layers"}
    zoo_rows = [
        # A free plan's budget is the profile's usable memory: not named.
        _gpu_row("gpt2", "2x4", "float32", 1000, 1050, {"batch": 100},
                 budget_bytes=5000),
        _gpu_row("llama", "2x4", "float32, budget 70%", 900, 970, {"batch": 100},
                 budget_bytes=1000, **budgeted),
        _gpu_row("opt", "2x4", "float32, budget 70%", 900, 1010, {"batch": 100},
                 budget_bytes=1000, **budgeted),
    ]  # fmt: skip
    text = render(zoo_rows, [], "python -m x", "this machine", 120)
    assert (
        "Planned under a budget, compiled against it: llama 2x4 float32, "
        "budget 70% 970 B of 1000 B (0.97); opt 2x4 float32, budget 70% "
        "1010 B of 1000 B (1.01); 1 of 2 compile within their budget." in text
    )
    assert "gpt2 2x4 float32 1.03 KiB of" not in text


def test_the_device_step_section_is_what_its_committed_results_render():
    # The GPU figures regenerate here, without a GPU, from the JSON the
    # device run wrote (committed beside the script).
    from benchmarks import device_step, device_step_report

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    results = []
    for path in device_step.RESULTS:
        with open(os.path.join(root, path)) as file:
            results.append(json.load(file))
    with open(os.path.join(root, "BENCHMARKS.md")) as file:
        published = read_section(file.read(), device_step.SECTION_NAME)
    assert published.strip() == device_step_report.render(results).strip()
    assert any(result.get("budget") for result in results)
    for result in results:
        assert result["gpu"]["kind"] == "NVIDIA H200"
        assert device_step.profile_for(result["gpu"]["kind"]) == result["profile"]
        if result.get("budget"):
            # A budgeted plan fits: the device's measured peak is within
            # the budget the plan was asked for.
            budget_bytes = result["plan"]["estimate"]["budget_bytes"]
            assert result["on_device"]["peak_bytes_in_use"] <= budget_bytes

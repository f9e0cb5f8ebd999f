"""The `keras-autoshard` command line, run as a subprocess on small models.

Each slow run (planning, compiling, benchmarking) happens once per module in
a fixture and is checked by several tests.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.xla_flags import child_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2_CONFIG = {
    "vocabulary_size": 1024,
    "num_layers": 2,
    "num_heads": 4,
    "hidden_dim": 64,
    "intermediate_dim": 256,
    "max_sequence_length": 64,
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m keras_autoshard ARGS` from the repository root."""
    env = child_env(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-m", "keras_autoshard", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


# ------------------------------------------------------------------- plan
@pytest.fixture(scope="module")
def gpt2_plan(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2_plan")
    config = directory / "gpt2.json"
    config.write_text(json.dumps(GPT2_CONFIG))
    paths = {"json": directory / "plan.json", "png": directory / "plan.png"}
    result = run_cli(
        "plan",
        "--hub",
        "GPT2Backbone",
        "--config",
        str(config),
        "--mesh",
        "2x4",
        "--seq-len",
        "32",
        "--json",
        str(paths["json"]),
        "--png",
        str(paths["png"]),
        "--hardware",
        "h100-80gb",
        "--rematerialize",
        "all",
        "--sequence-parallel",
    )
    return result, paths


def test_plan_prints_the_plan_table_totals_and_communication(gpt2_plan):
    result, _ = gpt2_plan
    assert result.returncode == 0, explain(result)
    out = result.stdout
    assert "Sharding plan on mesh batch=2 x model=4" in out
    assert "token_embedding/embeddings" in out
    assert "(embed, heads, head_dim)" in out  # logical roles
    assert "bytes/device" in out
    assert "Per device (planner estimate)" in out
    assert "communication per step" in out
    assert "over model" in out
    assert "peak per device" in out
    assert "76.00 GiB" in out  # the H100-80GB budget: 80 GiB less 5 %
    assert "step time on h100-80gb" in out


def test_plan_json_is_a_loadable_plan_for_the_requested_mesh(gpt2_plan):
    from keras_autoshard import ShardingPlan

    result, paths = gpt2_plan
    assert result.returncode == 0, explain(result)
    plan = ShardingPlan.load(str(paths["json"]))
    assert plan.mesh.shape == (2, 4)
    assert plan.batch_axis == "batch"
    query = plan.variable("transformer_layer_0/self_attention/query/kernel")
    assert query.spec == (None, "model", None)
    saved = json.loads(paths["json"].read_text())["estimate"]
    assert saved["peak_bytes"] == plan.estimate.peak_bytes > 0
    assert saved["hardware"] == "h100-80gb" and saved["step_time_s"] > 0
    # --rematerialize all: every transformer layer, as asked.
    assert plan.rematerialize == tuple(
        f"transformer_layer_{i}" for i in range(GPT2_CONFIG["num_layers"])
    )
    assert saved["recompute_flops"] > 0
    # --sequence-parallel: the residual stream cut along the tokens.
    assert any(lever.startswith("sequence parallelism") for lever in saved["levers"])
    assert plan.activation("transformer_layer_1/output").spec == (
        "batch",
        "model",
        None,
    )


def test_plan_png_is_a_nonempty_png_image(gpt2_plan):
    result, paths = gpt2_plan
    assert result.returncode == 0, explain(result)
    data = paths["png"].read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


def test_plan_png_draws_the_estimated_peak_against_the_budget(gpt2_plan, tmp_path):
    import dataclasses

    from keras_autoshard import ShardingPlan
    from keras_autoshard.plans.estimate import usable_budget
    from keras_autoshard.plans.units import format_bytes
    from keras_autoshard.report.plan_figure import (
        estimate_parts,
        estimate_title,
        save_plan_figure,
    )

    result, paths = gpt2_plan
    assert result.returncode == 0, explain(result)
    plan = ShardingPlan.load(str(paths["json"]))
    estimate = plan.estimate
    parts = dict(estimate_parts(estimate))
    assert sum(parts.values()) == estimate.peak_bytes
    assert parts["parameters"] == estimate.parameter_bytes > 0
    assert "fits the budget" in estimate_title(estimate)
    # Over a budget: the title says by how much, and the picture still draws.
    over = dataclasses.replace(estimate, budget_bytes=estimate.peak_bytes // 2)
    title = estimate_title(over)
    assert "over the part of the budget" in title
    usable = usable_budget(over.budget_bytes, estimate.compiler)
    assert format_bytes(estimate.peak_bytes - usable) in title
    path = tmp_path / "over.png"
    save_plan_figure(dataclasses.replace(plan, estimate=over), str(path))
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_plan_shows_a_planning_progress_bar_on_stderr(gpt2_plan):
    result, _ = gpt2_plan
    assert "planning" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- inspect
@pytest.fixture(scope="module")
def builder_inspect(tmp_path_factory):
    report_path = tmp_path_factory.mktemp("inspect") / "report.json"
    result = run_cli(
        "--devices",
        "8",
        "inspect",
        "--builder",
        "keras_autoshard.testing.zoo:build_mlp_block",
        "--json",
        str(report_path),
    )
    return result, report_path


def test_inspect_prints_the_compiled_report_beside_the_estimate(builder_inspect):
    result, _ = builder_inspect
    assert result.returncode == 0, explain(result)
    out = result.stdout
    assert "train_step: collectives in the optimized HLO" in out
    assert "XLA memory per device" in out
    assert "Planner estimate vs compiled program" in out
    rows = {
        line.split("│")[1].strip(): line for line in out.splitlines() if "│" in line
    }
    assert rows["parameters"].rstrip("│ ").endswith("ok")
    assert rows["train-step communication"].rstrip("│ ").endswith("ok")
    # The estimated peak (parameters, gradients, optimizer, activations kept,
    # data, transient) against arguments + outputs + temporaries - aliased.
    assert rows["peak per device (train step)"].rstrip("│ ").endswith("ok")


def test_inspect_flags_estimates_that_differ_by_more_than_the_tolerance():
    # An inference plan's estimated peak is compared with the compiled
    # forward step's, a few percent off on this model: with a tolerance of
    # 0.1 % that row must be flagged.
    result = run_cli(
        "--devices",
        "8",
        "inspect",
        "--builder",
        "keras_autoshard.testing.zoo:build_mlp_block",
        "--job",
        "inference",
        "--tolerance",
        "0.001",
    )
    assert "DIFFERS (>0%)" in result.stdout or "DIFFERS (>0.1%)" in result.stdout
    assert "peak per device (forward step)" in result.stdout
    assert "train-step communication" not in result.stdout
    assert "differ from the compiled program by more than" in result.stdout


def test_inspect_compiles_the_layers_a_plan_rematerializes():
    # The estimate of a plan that rematerializes counts only the recomputed
    # layers' inputs; the compiled step must recompute them too (scheduled
    # for memory on XLA:CPU, whose defaults merge the recomputation away).
    # As planned, this GPT-2's step peaks at 12.50 MiB against an estimate
    # of 11.77 MiB (-6 %).
    config = (
        '{"vocabulary_size": 1024, "num_layers": 2, "num_heads": 8, '
        '"hidden_dim": 256, "intermediate_dim": 1024, "max_sequence_length": 64}'
    )
    result = run_cli(
        "--devices",
        "8",
        "inspect",
        "--hub",
        "GPT2Backbone",
        "--config",
        config,
        "--mesh",
        "2x4",
        "--batch",
        "8",
        "--seq-len",
        "64",
        "--rematerialize",
        "all",
    )
    assert result.returncode == 0, explain(result)
    words = " ".join(result.stdout.split())
    assert "2 layer(s) rematerialized; scheduled for memory" in words
    rows = {
        line.split("│")[1].strip(): line
        for line in result.stdout.splitlines()
        if "│" in line
    }
    assert rows["peak per device (train step)"].rstrip("│ ").endswith("ok"), words


def test_inspect_refuses_the_generate_job_with_what_to_do(capsys):
    from keras_autoshard.cli.main import main

    code = main(
        [
            "inspect",
            "--builder",
            "keras_autoshard.testing.zoo:build_mlp_block",
            "--job",
            "generate",
        ]
    )
    assert code == 1
    error = capsys.readouterr().err
    assert "--job generate" in error and "benchmarks.generate_cache" in error


def test_inspect_json_holds_the_compiled_report(builder_inspect):
    result, report_path = builder_inspect
    assert result.returncode == 0, explain(result)
    report = json.loads(report_path.read_text())
    assert report["train_step"]["collectives"]
    assert report["parameter_bytes_per_device"] > 0


@pytest.fixture(scope="module")
def keras_file(tmp_path_factory):
    from keras_autoshard.testing.zoo import build_mlp_block

    path = tmp_path_factory.mktemp("keras_file") / "mlp.keras"
    build_mlp_block().save(str(path))
    return path


def test_inspect_of_a_keras_file_loads_its_weights_sharded(keras_file):
    result = run_cli("inspect", "--keras-file", str(keras_file), "--mesh", "2x4")
    assert result.returncode == 0, explain(result)
    assert "Planned " + str(keras_file) + " on mesh batch=2 x model=4" in result.stdout
    assert "loading mlp.keras" in result.stderr  # the load's progress bar


# ----------------------------------------------------------------- errors
def test_a_budget_no_plan_fits_is_an_error_without_traceback():
    result = run_cli(
        "plan",
        "--builder",
        "keras_autoshard.testing.zoo:build_mlp_block",
        "--memory-budget",
        "1KiB",
    )
    assert result.returncode == 1, explain(result)
    assert "keras-autoshard plan: error: No plan fits" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_that_builds_a_degenerate_model_is_refused_naming_the_field():
    config = (
        '{"vocabulary_size": 64, "num_layers": -1, "num_heads": 2, '
        '"hidden_dim": 16, "intermediate_dim": 32, "max_sequence_length": 8}'
    )
    result = run_cli("plan", "--hub", "GPT2Backbone", "--config", config)
    assert result.returncode == 1, explain(result)
    assert "--config field 'num_layers' of GPT2Backbone is -1" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_builder_that_cannot_be_imported_is_an_error_without_traceback():
    result = run_cli("plan", "--builder", "no_such_module:build", "--mesh", "1x8")
    assert result.returncode == 1, explain(result)
    assert "Cannot import 'no_such_module'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--mesh", "2x4"], "one of the arguments --hub --builder"),
        (["plan", "--hub", "GPT2Backbone", "--mesh", "2by4"], "mesh must look like"),
        (
            ["plan", "--hub", "GPT2Backbone", "--memory-budget", "lots"],
            "size must look like 16GiB",
        ),
        (
            ["plan", "--keras-file", "m.keras", "--config", "{}"],
            "--config goes with --hub or --builder",
        ),
        (
            ["plan", "--hub", "GPT2Backbone", "--mesh", "2x4", "--devices", "4"],
            "spans 8 devices but --devices is 4",
        ),
        (["inspect", "--hub", "GPT2Backbone", "--rule", "nospec"], "REGEX=SPEC"),
        (["bench", "--only", "no_such_benchmark"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_give_a_usage_error_and_exit_code_2(args, message):
    result = run_cli(*args, timeout=60)
    assert result.returncode == 2, explain(result)
    assert "usage: keras-autoshard" in result.stderr
    assert message in result.stderr


# ------------------------------------------------------------------ bench
def test_bench_lists_every_benchmark_with_its_section():
    result = run_cli("bench", "--list", timeout=60)
    assert result.returncode == 0, explain(result)
    for name, section in [
        ("strategies", "sharding-strategies"),
        ("plan_70b", "planning-70b"),
        ("checkpoint_loading", "checkpoint-loading"),
        ("memory_truth_gpu", "memory-truth-gpu"),
        ("real_size_gpu", "real-size-gpu"),
    ]:
        assert name in result.stdout
        assert section in result.stdout


def test_bench_dry_run_prints_each_command_with_the_output_file(tmp_path):
    # A path longer than the console's 160 columns: each command stays one
    # line, to be copied whole (CI's temporary paths are long).
    output = tmp_path / ("long_folder_name_" * 10) / "BENCH.md"
    result = run_cli(
        "bench", "--dry-run", "--quick", "--only", "strategies", "tensor_parallel",
        "--output", str(output), timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, explain(result)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "-m benchmarks.run_benchmarks --output" in lines[0]
    assert lines[0].endswith("--quick")
    assert "-m benchmarks.tensor_parallel" in lines[1]
    assert not output.exists()


def test_bench_runs_a_quick_benchmark_and_rewrites_only_its_section(tmp_path):
    output = tmp_path / "BENCH.md"
    output.write_text(
        "# Benchmarks\n\nkept text\n\n"
        "<!-- section:other -->\nother\n<!-- end:other -->\n"
    )
    result = run_cli(
        "bench", "--only", "plan_70b", "--quick", "--output", str(output), timeout=300
    )
    assert result.returncode == 0, explain(result)
    text = output.read_text()
    assert "kept text" in text
    assert "<!-- section:other -->\nother\n<!-- end:other -->" in text
    assert "<!-- section:planning-70b -->" in text
    assert "| batch=32 x model=8 |" in text
    assert "Benchmarks written to" in result.stdout
    assert "plan_70b" in result.stdout and "ok" in result.stdout


# ------------------------------------------------------ pure helpers (fast)
@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30),
        ("1.5 gib", 3 * 2**29),
        ("512MB", 512 * 10**6),
        ("8G", 8 * 2**30),
        ("1024", 1024),
    ],
)
def test_memory_budget_sizes_parse_with_binary_and_decimal_units(text, expected):
    from keras_autoshard.cli.model_sources import parse_byte_size

    assert parse_byte_size(text) == expected


def test_estimate_checks_flag_only_differences_over_the_tolerance():
    from keras_autoshard.report.estimate_check import EstimateCheck

    assert not EstimateCheck("x", 105.0, 100.0).flagged
    assert EstimateCheck("x", 111.0, 100.0).flagged
    assert EstimateCheck("x", 89.0, 100.0).flagged
    assert EstimateCheck("x", 1.0, 0.0).flagged
    assert not EstimateCheck("x", 0.0, 0.0).flagged


def test_figure_layout_gives_each_column_block_to_its_model_axis_devices():
    from keras_autoshard import MeshSpec
    from keras_autoshard.report.plan_figure import block_devices
    from keras_autoshard.types import VariableSharding

    mesh = MeshSpec((2, 4), ("batch", "model"))
    kernel = VariableSharding("up/kernel", (64, 256), "float32", (None, "model"))
    assert block_devices(kernel, mesh) == {
        (0, 0): [0, 4],
        (0, 1): [1, 5],
        (0, 2): [2, 6],
        (0, 3): [3, 7],
    }


def test_figure_device_labels_do_not_overlap(gpt2_plan):
    # In the picture of a plan (GPT-2 on 2x4, estimate drawn: its layout
    # panels narrow) a kernel cut 4 ways over its columns printed its labels
    # side by side, running into each other ("dev 0,4dev 1,5...").
    from keras_autoshard import ShardingPlan
    from keras_autoshard.report.plan_figure import plan_figure

    result, paths = gpt2_plan
    assert result.returncode == 0, explain(result)
    plan = ShardingPlan.load(str(paths["json"]))
    figure = plan_figure(plan)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    panels = [axes for axes in figure.axes if "\n" in axes.get_title()]  # layouts
    assert any(len(axes.patches) == 4 for axes in panels)
    for axes in panels:
        # Each block's label stays inside its block (blocks and labels are
        # drawn in the same order), so no label runs into the next.
        assert len(axes.patches) == len(axes.texts)
        for block, text in zip(axes.patches, axes.texts):
            box = text.get_window_extent(renderer)
            edges = block.get_window_extent(renderer)
            inside = (
                edges.x0 <= box.x0 and box.x1 <= edges.x1
                and edges.y0 <= box.y0 and box.y1 <= edges.y1
            )  # fmt: skip
            assert inside, (axes.get_title(), text.get_text(), box, edges)

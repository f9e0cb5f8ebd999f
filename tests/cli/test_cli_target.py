"""`keras-autoshard inspect --target NAME`: the plan's train step compiled by
XLA:GPU for the mesh's number of the target's GPUs, with no device used and
no weight allocated (`cli/plan.py`, `apply/jax/target_compile.py`)."""

import json
import os
import subprocess
import sys

import pytest

from tests.cli.test_cli import REPO_ROOT, explain

LLAMA_CONFIG = {
    "vocabulary_size": 1024,
    "num_layers": 2,
    "num_query_heads": 8,
    "num_key_value_heads": 2,
    "hidden_dim": 256,
    "intermediate_dim": 1024,
}


@pytest.fixture(scope="module")
def llama_inspect(tmp_path_factory):
    report_path = tmp_path_factory.mktemp("inspect_target") / "report.json"
    # As a user runs it: JAX_PLATFORMS unset (the command sets it before JAX
    # starts) and no simulated devices asked for.
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")
    }
    env.update(KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_autoshard",
            "inspect",
            "--target",
            "h100-80gb",
            "--hub",
            "LlamaBackbone",
            "--config",
            json.dumps(LLAMA_CONFIG),
            "--mesh",
            "2x4",
            "--batch",
            "8",
            "--seq-len",
            "64",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    return result, report_path


def _rows(stdout: str) -> dict[str, list[str]]:
    """First cell → the cells of each table row starting with it (the
    collective table has a row per kind and mesh axes)."""
    rows = {}
    for line in stdout.splitlines():
        if "│" in line:
            cells = [cell.strip() for cell in line.strip("│ ").split("│")]
            rows.setdefault(cells[0], []).append(cells)
    return rows


def test_inspect_target_compiles_with_xla_gpu_for_the_meshs_gpus(llama_inspect):
    result, _ = llama_inspect
    assert result.returncode == 0, explain(result)
    words = " ".join(result.stdout.split())
    assert "compiled by XLA:GPU for 8 h100-80gb GPUs" in words
    assert "ahead of time, no weights allocated" in words
    assert (
        "Compiled peak per device" in words and "of the h100-80gb's 80.00 GiB" in words
    )
    assert "Traceback" not in result.stderr


def test_inspect_target_shows_collectives_over_each_mesh_axis(llama_inspect):
    result, _ = llama_inspect
    assert result.returncode == 0, explain(result)
    axes = {cells[1] for cells in _rows(result.stdout).get("all-reduce", [])}
    assert {"batch", "model"} <= axes


def test_inspect_target_checks_the_estimates_against_the_compiled_step(llama_inspect):
    result, _ = llama_inspect
    assert result.returncode == 0, explain(result)
    rows = _rows(result.stdout)
    # Variable bytes are read off the planned shardings of the abstract state.
    assert rows["parameters"][0][-1] == "ok"
    assert rows["optimizer state"][0][-1] == "ok"
    for quantity in (
        "peak per device (train step)",
        "communication over batch",
        "communication over model",
    ):
        assert quantity in rows, result.stdout


def test_inspect_target_json_holds_the_compile_and_the_checks(llama_inspect):
    result, report_path = llama_inspect
    assert result.returncode == 0, explain(result)
    report = json.loads(report_path.read_text())
    assert report["compiler"] == "XLA:GPU" and report["target"] == "h100-80gb"
    assert report["device_count"] == 8
    assert report["compiled_peak_bytes"] > report["parameter_bytes_per_device"] > 0
    assert report["train_step"]["collective_summary"]
    checked = {check["quantity"] for check in report["estimate_checks"]}
    assert "peak per device (train step)" in checked


def test_inspect_target_without_the_cuda_plugin_names_the_extra(monkeypatch, capsys):
    from keras_autoshard.cli.main import main
    from keras_autoshard.runtime import gpu_targets

    real_find_spec = gpu_targets.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_targets.importlib.util,
        "find_spec",
        lambda name: None if name.startswith("jax_plugins") else real_find_spec(name),
    )
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    code = main(
        [
            "inspect",
            "--target",
            "h100-80gb",
            "--builder",
            "keras_autoshard.testing.zoo:build_mlp_block",
            "--mesh",
            "2x4",
        ]
    )
    assert code == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert error.startswith("keras-autoshard inspect: error: Compiling for a GPU")
    assert 'pip install "keras-autoshard[gpu-compile]"' in error


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "tpu-v5e"], "invalid choice: 'tpu-v5e'"),
        (["--target", "h100-80gb", "--job", "inference"], "--job inference"),
    ],
)
def test_inspect_target_usage_errors(args, message, capsys):
    from keras_autoshard.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "inspect",
                "--builder",
                "keras_autoshard.testing.zoo:build_mlp_block",
                *args,
            ]
        )
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

"""simulate_devices sets XLA's host device count, and refuses when too late."""

import os
import subprocess
import sys

import pytest

from keras_autoshard import simulate_devices
from keras_autoshard.errors import DeviceSetupError


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["KERAS_BACKEND"] = "jax"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_simulate_devices_before_jax_starts_gives_that_many_devices():
    result = _run(
        "from keras_autoshard import simulate_devices; simulate_devices(4);"
        "import jax; print(jax.device_count())"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "4"


def test_simulate_devices_after_jax_started_with_fewer_devices_raises():
    result = _run(
        "import jax; jax.devices();"
        "from keras_autoshard import simulate_devices; simulate_devices(16)"
    )
    assert result.returncode != 0
    assert "DeviceSetupError" in result.stderr
    assert "already initialised with 1 device(s), fewer than the 16" in result.stderr


def test_simulate_devices_in_this_process_is_a_no_op_when_enough_devices():
    import jax

    assert jax.device_count() == 8
    assert simulate_devices(4) == 8
    with pytest.raises(DeviceSetupError, match="fewer than the 9"):
        simulate_devices(9)


def test_simulate_devices_replaces_an_existing_count_flag(monkeypatch):
    from keras_autoshard.runtime import devices

    monkeypatch.setattr(devices, "_running_jax_device_count", lambda: None)
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=2"
    )
    devices.simulate_devices(6)
    assert os.environ["XLA_FLAGS"] == (
        "--xla_foo=1 --xla_force_host_platform_device_count=6"
    )


def test_the_planning_worker_keeps_the_callers_other_xla_flags(monkeypatch):
    """The torch backend plans in a JAX subprocess
    (`planner.subprocess_planning`); its `XLA_FLAGS` are the caller's (a
    dump folder, compiler options) with the worker's own device count, not
    the device count alone."""
    from keras_autoshard.planner import subprocess_planning

    seen = {}

    def run(command, **kwargs):
        seen.update(kwargs["env"])
        return subprocess.CompletedProcess(command, 0, '{"plan": null}', "")

    monkeypatch.setattr(subprocess_planning.subprocess, "run", run)
    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8"
    )
    subprocess_planning.run_plan_worker(
        {"mesh": {"shape": [1, 2], "axes": ["batch", "model"]}}
    )
    assert seen["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2"
    )

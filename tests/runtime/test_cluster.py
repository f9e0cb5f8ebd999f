"""Finding the cluster from arguments and launcher environment variables."""

from __future__ import annotations

import pytest

from keras_autoshard.runtime.cluster import (
    ClusterError,
    ClusterSpec,
    first_slurm_host,
    resolve_cluster,
)


def test_no_arguments_and_no_launcher_variables_is_a_single_process():
    spec = resolve_cluster(environ={})
    assert spec == ClusterSpec(None, 1, 0, "single process")
    assert not spec.is_multi_process


def test_arguments_win_over_the_environment():
    environ = {"SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "8", "SLURM_PROCID": "3"}
    spec = resolve_cluster("10.0.0.1:1234", 2, 1, environ=environ)
    assert spec == ClusterSpec("10.0.0.1:1234", 2, 1, "arguments")


def test_keras_job_address_list_takes_its_first_address_as_coordinator():
    spec = resolve_cluster(
        environ={
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:2345",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
            "KERAS_DISTRIBUTION_PROCESS_ID": "1",
        }
    )
    assert spec == ClusterSpec("10.0.0.1:1234", 2, 1, "keras")


def test_jax_variables_are_read():
    spec = resolve_cluster(
        environ={
            "JAX_COORDINATOR_ADDRESS": "host0:9999",
            "JAX_NUM_PROCESSES": "4",
            "JAX_PROCESS_ID": "2",
        }
    )
    assert spec == ClusterSpec("host0:9999", 4, 2, "jax")


def test_torchrun_variables_are_read():
    spec = resolve_cluster(
        environ={
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29600",
            "WORLD_SIZE": "4",
            "RANK": "3",
        }
    )
    assert spec == ClusterSpec("127.0.0.1:29601", 4, 3, "torchrun")


@pytest.mark.parametrize(
    "node_list, host",
    [
        ("gpu017", "gpu017"),
        ("gpu[017-020]", "gpu017"),
        ("gpu[017-020,031],cpu1", "gpu017"),
        ("a-node,b-node", "a-node"),
        ("tpu[3,5-7]", "tpu3"),
    ],
)
def test_first_slurm_host(node_list, host):
    assert first_slurm_host(node_list) == host


def test_slurm_variables_give_the_first_node_as_coordinator():
    spec = resolve_cluster(
        environ={
            "SLURM_STEP_NODELIST": "gpu[017-020]",
            "SLURM_NTASKS": "4",
            "SLURM_PROCID": "1",
            "KERAS_AUTOSHARD_COORDINATOR_PORT": "6000",
        }
    )
    assert spec == ClusterSpec("gpu017:6000", 4, 1, "slurm")


def test_partial_arguments_are_an_error_naming_what_is_missing():
    with pytest.raises(ClusterError, match=r"not \['process_id'\]"):
        resolve_cluster("host:1", 2, environ={})


def test_partial_environment_is_an_error_naming_the_missing_variable():
    with pytest.raises(ClusterError, match="JAX_PROCESS_ID"):
        resolve_cluster(
            environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (("h:1", 2, 2), r"process_id 2 is not in \[0, 2\)"),
        (("h:1,h:2,h:3", 2, 0), "3 job addresses"),
        (("h:1", "two", 0), "must be integers"),
    ],
)
def test_contradictory_values_are_errors(args, message):
    with pytest.raises(ClusterError, match=message):
        resolve_cluster(*args, environ={})


def test_an_address_without_port_gets_the_default_port():
    assert resolve_cluster("host", 2, 0, environ={}).coordinator_address == (
        "host:29500"
    )

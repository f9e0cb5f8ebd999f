"""TensorFlow backend, in its own process: data parallelism through
MirroredStrategy matches one device, planning gives the JAX plan, and tensor
parallelism is refused with an error that names the alternatives."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tensorflow")

import keras_autoshard as ka  # noqa: E402
from keras_autoshard import MeshSpec  # noqa: E402
from keras_autoshard.apply.tensor_parallel_setup import resolve_backend  # noqa: E402
from keras_autoshard.errors import PlanError, TensorParallelError  # noqa: E402
from tests.workers import tensorflow_backend_worker as worker  # noqa: E402
from tests.xla_flags import child_env  # noqa: E402

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
WORKER = os.path.join(ROOT, "tests", "workers", "tensorflow_backend_worker.py")
DEVICES = 4
RUN_TIMEOUT_S = 240
RTOL = 1e-5


@pytest.fixture(scope="module")
def tensorflow_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensorflow") / "result.json"
    env = child_env(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, WORKER, str(DEVICES), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0 and out.exists(), done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["keras_backend"] == "tensorflow"
    assert result["devices"] == [f"cpu:{i}" for i in range(DEVICES)]
    return result


def relative_gap(losses, reference):
    assert len(losses) == len(reference) == worker.STEPS
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


@pytest.mark.slow
@pytest.mark.parametrize("name", worker.MODELS)
def test_tensor_parallel_world_size_1_matches_one_device_after_5_adam_steps(
    tensorflow_run, name
):
    run = tensorflow_run["models"][name]
    assert run["wrapper"] == "TensorFlowTensorParallel"
    assert run["is_tensor_parallel"]  # isinstance(wrapper, ka.TensorParallel)
    assert run["replicas"] == DEVICES
    assert run["mirrored_variables"] == run["variables"]
    single = run["single_device"]
    assert single[-1] < single[0]  # it trains
    assert relative_gap(run["tensor_parallel_world_size_1"], single) < RTOL


@pytest.mark.slow
def test_distribution_scope_trains_data_parallel_like_one_device(tensorflow_run):
    run = tensorflow_run["distribution"]
    assert run["type"] == "TensorFlowAutoShardDistribution"
    assert run["is_auto_shard_distribution"]
    assert run["mesh"] == [DEVICES, 1] and run["replicated"]
    single = tensorflow_run["models"]["mlp"]["single_device"]
    assert relative_gap(run["losses"], single) < RTOL


@pytest.mark.slow
@pytest.mark.parametrize("name", worker.MODELS)
def test_plan_made_under_tensorflow_equals_the_jax_plan(tensorflow_run, name):
    x, _ = worker.batch(name)
    mesh = MeshSpec((DEVICES, 1), ("batch", "model"))
    jax_plan = ka.plan(lambda: worker.build(name), mesh, sample_input=x)
    tensorflow_plan = ka.ShardingPlan.from_json(tensorflow_run["models"][name]["plan"])
    assert tensorflow_plan == jax_plan


@pytest.mark.slow
def test_model_parallel_plan_under_tensorflow_equals_the_jax_plan(tensorflow_run):
    x, _ = worker.batch("embed_einsum")
    mesh = MeshSpec((2, 2), ("batch", "model"))
    jax_plan = ka.plan(lambda: worker.build("embed_einsum"), mesh, sample_input=x)
    tensorflow_plan = ka.ShardingPlan.from_json(tensorflow_run["model_parallel_plan"])
    assert tensorflow_plan == jax_plan
    assert any("model" in v.spec for v in tensorflow_plan.variables)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "tensor_parallel_world_size_2",
        "tensor_parallel_default_world_size",
        "distribution_model_axis_2",
        "model_parallel_plan",
    ],
)
def test_tensor_parallelism_under_tensorflow_raises_naming_the_alternatives(
    tensorflow_run, case
):
    error = tensorflow_run["errors"][case]
    assert error is not None, f"{case} did not raise"
    assert error["type"] == "TensorFlowModelParallelError"
    assert {"TensorParallelError", "PlanError"} <= set(error["bases"])
    message = error["message"]
    for needed in ("KERAS_BACKEND=jax", "KERAS_BACKEND=torch", "world_size=1"):
        assert needed in message
    assert "dtensor" in message and "docs/tensorflow.md" in message


@pytest.mark.slow
def test_planning_in_a_tensorflow_process_names_the_backend_not_the_model(
    tensorflow_run,
):
    error = tensorflow_run["errors"]["plan_in_this_process"]
    assert error is not None, "plan() under TensorFlow did not raise"
    assert error["type"] == "PlanError"  # not ModelNotTraceableError
    message = error["message"]
    for needed in (
        "Keras runs on 'tensorflow'",
        "KERAS_BACKEND=jax",
        "AutoShardDistribution",
        "plan_for_tensorflow",
    ):
        assert needed in message
    assert "TracerArrayConversionError" not in message


def test_asking_for_tensorflow_under_jax_is_an_error():
    with pytest.raises(TensorParallelError, match="KERAS_BACKEND=tensorflow"):
        resolve_backend("tensorflow")
    assert issubclass(TensorParallelError, ValueError)
    assert issubclass(PlanError, ValueError)

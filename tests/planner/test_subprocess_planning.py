"""The backend-neutral half of planning in a JAX subprocess: moving a plan made
for a copy of the model onto the local model's paths."""

import dataclasses

import keras
import numpy as np

import keras_autoshard as ka
from keras_autoshard import MeshSpec
from keras_autoshard.planner.subprocess_planning import align_plan, planning_request
from keras_autoshard.plans.sharding_plan import ActivationLayout


def _embedder(prefix):
    tokens = keras.Input((16,), dtype="int32")
    hidden = keras.layers.Embedding(64, 32, name=f"{prefix}_table")(tokens)
    outputs = keras.layers.Dense(8, name=f"{prefix}_head")(hidden)
    return keras.Model(tokens, outputs)


def test_activation_layouts_follow_their_layer_to_the_local_path():
    planned = _embedder("planned")
    mesh = MeshSpec((1, 2), ("batch", "model"))
    plan = ka.plan(planned, mesh, np.zeros((4, 16), "int32"))
    plan = dataclasses.replace(
        plan,
        activations=(
            ActivationLayout("planned_table/output", (None, None, "model")),
            ActivationLayout("no_variables/output", ("batch", None, None)),
        ),
    )
    local = _embedder("local")
    aligned = align_plan(plan, [v.path for v in planned.variables], local)
    assert {v.path for v in aligned.variables} == {v.path for v in local.variables}
    assert aligned.activation("local_table/output").spec == (None, None, "model")
    assert aligned.activation("planned_table/output") is None
    # A layout of a layer that owns no variable keeps its path.
    assert aligned.activation("no_variables/output").spec == ("batch", None, None)


def test_planning_request_is_json_data_without_the_compile_config():
    model = _embedder("m")
    model.compile(optimizer="adam", loss="mse")
    request = planning_request(
        model,
        MeshSpec((2, 4), ("batch", "model")),
        np.zeros((4, 16), "int32"),
        memory_budget=1000,
        rules={"m_head/kernel": (None, "model")},
    )
    assert "compile_config" not in request["model"]
    assert request["inputs"] == {"shape": [4, 16], "dtype": "int32"}
    assert request["mesh"] == {"shape": [2, 4], "axes": ["batch", "model"]}
    assert request["rules"] == {"m_head/kernel": [None, "model"]}
    assert request["memory_budget"] == 1000

"""The JAX side of planning in a subprocess (`planner/planning_worker.py`),
answered in this process."""

import keras
import numpy as np

from keras_autoshard.planner.planning_worker import answer
from keras_autoshard.planner.subprocess_planning import planning_request
from keras_autoshard.plans.sharding_plan import MeshSpec, ShardingPlan
from tests.planner.small_models import BATCH, TOKENS

MESH = MeshSpec((2, 4), ("batch", "model"))


def mlp():
    """Built-in layers only: the worker rebuilds the model from its config."""
    return keras.Sequential(
        [
            keras.Input((TOKENS,), dtype="int32", batch_size=BATCH),
            keras.layers.Embedding(50, 16, name="table"),
            keras.layers.Dense(64, activation="relu", name="up"),
            keras.layers.Dense(16, name="down"),
        ],
        name="mlp",
    )


def test_a_request_is_answered_with_the_plan_and_the_planned_paths():
    model = mlp()
    request = planning_request(model, MESH, np.zeros((BATCH, TOKENS), "int32"))
    reply = answer(request)
    # The rebuilt model's own paths, in `model.variables` order: Keras
    # prefixes the local Sequential's paths with its name, the rebuilt
    # one's not (`remote.align_plan` matches them by position).
    paths = ["table/embeddings", "up/kernel", "up/bias", "down/kernel", "down/bias"]
    assert reply["paths"] == paths
    assert [v.path for v in model.variables] == [f"mlp/{p}" for p in paths]
    planned = ShardingPlan.from_json(reply["plan"])
    specs = {v.path: tuple(v.spec) for v in planned.variables}
    assert specs == {
        "table/embeddings": (None, None),
        "up/kernel": (None, "model"),
        "up/bias": ("model",),
        "down/kernel": ("model", None),
        "down/bias": (None,),
    }


def test_a_rule_in_the_request_pins_its_variables():
    model = mlp()
    request = planning_request(
        model,
        MESH,
        np.zeros((BATCH, TOKENS), "int32"),
        rules={"table/embeddings": (None, "model")},
    )
    planned = ShardingPlan.from_json(answer(request)["plan"])
    assert planned.variable("table/embeddings").spec == (None, "model")

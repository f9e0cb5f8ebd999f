"""The JAX side of `subprocess_planning.run_plan_worker`.

Reads a request (JSON) on stdin, prints
`{"plan": ..., "paths": [...]}` or `{"error": ...}` as the last stdout line.

Run as `python -m keras_autoshard.planner.planning_worker` with
`KERAS_BACKEND=jax`; the parent sets the simulated device count.
"""

from __future__ import annotations

import importlib
import json
import sys


def _decode_inputs(encoded):
    import jax
    import numpy as np

    if "dict" in encoded:
        return {k: _decode_inputs(v) for k, v in encoded["dict"].items()}
    if "list" in encoded:
        return [_decode_inputs(v) for v in encoded["list"]]
    return jax.ShapeDtypeStruct(tuple(encoded["shape"]), np.dtype(encoded["dtype"]))


def answer(request: dict) -> dict:
    """Plan the serialised model of `request` (see `planning_request`)."""
    import keras

    from keras_autoshard.planner.planner import plan
    from keras_autoshard.plans.sharding_plan import MeshSpec, unique_variables
    from keras_autoshard.trace.tracer import build_abstract

    for module in request["modules"]:
        importlib.import_module(module)
    model = build_abstract(
        lambda: keras.saving.deserialize_keras_object(request["model"])
    )
    mesh = MeshSpec(tuple(request["mesh"]["shape"]), tuple(request["mesh"]["axes"]))
    result = plan(
        model,
        mesh,
        sample_input=_decode_inputs(request["inputs"]),
        memory_budget=request["memory_budget"],
        rules={k: tuple(v) for k, v in request["rules"].items()} or None,
        batch_over_model_axes=request.get("batch_over_model_axes", True),
    )
    paths = [v.path for v in unique_variables(model.variables)]
    return {"plan": result.to_json(indent=None), "paths": paths}


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        reply = answer(request)
    except Exception as error:  # noqa: BLE001 - reported to every rank
        reply = {"error": f"Planning failed: {type(error).__name__}: {error}"}
    print(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())

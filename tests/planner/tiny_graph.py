"""A hand-built axis graph of one matrix product, `y = x @ w`, for the
planner's unit tests (no model, no trace, no compile).

Classes: 0 the batch (8), 1 the contracted features (16), 2 the output
features (32). Cutting class 1 leaves `y` partial (a forward all-reduce);
cutting the batch leaves `w`'s gradient partial (a backward all-reduce).
"""

from keras_autoshard.graph.axis_graph import AxisClass, AxisGraph, CommEvent, TensorNode
from keras_autoshard.planner.cost_model import PlannerOptions
from keras_autoshard.planner.mesh_axis import planning_axes
from keras_autoshard.plans.mesh import MeshSpec

BATCH, FEATURES, OUTPUTS = 8, 16, 32
MESH = MeshSpec((2, 4), ("batch", "model"))


def dense_graph(itemsize: int = 4) -> AxisGraph:
    """`y = x @ w` with `x` an input (8, 16), `w` a parameter (16, 32)."""
    x = TensorNode(0, (BATCH, FEATURES), itemsize, "input", "x", (0, 1), False)
    w = TensorNode(1, (FEATURES, OUTPUTS), itemsize, "param", "w", (1, 2), True)
    y = TensorNode(2, (BATCH, OUTPUTS), itemsize, "activation", None, (0, 2), True)
    classes = (
        AxisClass(0, BATCH, None, ((0, 0), (2, 0))),
        AxisClass(1, FEATURES, None, ((0, 1), (1, 0))),
        AxisClass(2, OUTPUTS, None, ((1, 1), (2, 1))),
    )
    events = (
        CommEvent("contract", "forward", (1,), 2, 1, "dot_general"),
        CommEvent("contract", "backward", (0,), 1, 1, "dot_general"),
    )
    return AxisGraph(
        tensors=(x, w, y),
        classes=classes,
        comm_events=events,
        slice_edges=(),
        unknown_primitives=(),
        outputs=(2,),
        param_readers=((1, ("dense",)),),
        input_readers=((0, ("dense",)),),
        tensor_layers=("", "dense", "dense"),
    )


def axes():
    """The planning axes of `MESH` (batch, model and one spanning both)."""
    return planning_axes(MESH)


def options(**changes) -> PlannerOptions:
    """Planner options for the tests (no budget unless given)."""
    return PlannerOptions(**changes)

"""`mesh_axis`: the axes a plan may cut over, named by their role."""

from keras_autoshard.planner.mesh_axis import (
    MeshAxis,
    covering,
    mesh_axes,
    planning_axes,
)
from keras_autoshard.plans.mesh import MeshSpec


def test_axes_are_data_or_model_axes_by_name():
    assert MeshAxis.named("batch", 2) == MeshAxis("batch", 2, data_only=True)
    assert MeshAxis.named("model", 4) == MeshAxis("model", 4, model_only=True)
    assert MeshAxis.named("x", 4) == MeshAxis("x", 4)


def test_a_mesh_of_several_axes_adds_one_spanning_them_all():
    axes = planning_axes(MeshSpec((2, 4), ("batch", "model")))
    spanning = MeshAxis("batch+model", 8, members=("batch", "model"))
    assert axes[-1] == spanning
    assert spanning.covers == ("batch", "model")
    assert mesh_axes(axes) == axes[:2]
    assert covering(axes, "model") == (axes[1], spanning)


def test_axes_of_size_one_are_left_out():
    axes = planning_axes(MeshSpec((1, 8), ("batch", "model")))
    assert axes == (MeshAxis("model", 8, model_only=True),)

"""Hardware profiles: the default budget, the step time of the estimate,
bandwidth by mesh axis, and the CLI's `--hardware`."""

import numpy as np
import pytest

from keras_autoshard import MeshSpec, plan
from keras_autoshard.errors import PlanError
from keras_autoshard.plans.hardware import (
    PROFILES,
    axis_bandwidths,
    hardware_profile,
)
from keras_autoshard.runtime.devices import accelerator_memory_budget
from keras_autoshard.testing import zoo

GiB = 2**30


def test_profiles_cover_the_usual_accelerators_and_keep_a_reserve():
    assert {"h100-80gb", "a100-40gb", "tpu-v5e", "tpu-v5p"} <= set(PROFILES)
    h100 = hardware_profile("H100-80GB")
    assert h100.memory_bytes == 80 * GiB
    assert h100.memory_budget_bytes == 76 * GiB  # 5 % kept back
    assert hardware_profile("tpu-v5e").memory_budget_bytes == 15 * GiB  # 1 GiB floor


def test_an_unknown_profile_names_the_known_ones():
    with pytest.raises(PlanError, match="h100-80gb"):
        hardware_profile("h200-141gb")


def test_inner_mesh_axes_stay_within_a_node():
    h100 = hardware_profile("h100-80gb")
    bandwidths = axis_bandwidths(h100, ("batch", "model"), (32, 8))
    assert bandwidths == {
        "batch": h100.inter_node_bytes_per_s,
        "model": h100.intra_node_bytes_per_s,
    }
    assert set(axis_bandwidths(h100, ("batch", "model"), (2, 4)).values()) == {
        h100.intra_node_bytes_per_s
    }


def test_the_profile_sets_the_budget_and_the_estimate_gives_the_step_time():
    x, _ = zoo.mlp_batch(hidden=64, seq=16, batch=8)
    sharding_plan = plan(
        zoo.build_mlp_block,
        MeshSpec((2, 4), ("batch", "model")),
        x,
        hardware="a100-40gb",
    )
    estimate = sharding_plan.estimate
    profile = hardware_profile("a100-40gb")
    assert estimate.budget_bytes == profile.memory_budget_bytes
    assert estimate.hardware == "a100-40gb"
    assert estimate.fits
    # Contractions: up (64 -> 256) and down (256 -> 64) over 8 x 16 tokens,
    # forward and backward (x3), split over all 8 devices.
    flops = 3 * 2 * (2 * 8 * 16 * 64 * 256) / 8
    assert estimate.compute_flops == pytest.approx(flops)
    moving = sum(
        b / profile.intra_node_bytes_per_s
        for b in estimate.communication_by_axis.values()
    )
    assert estimate.step_time_s == pytest.approx(
        flops / profile.peak_bf16_flops + moving
    )


def test_simulated_cpu_devices_have_no_default_budget():
    assert accelerator_memory_budget() is None
    x = np.zeros((8, 16, 64), "float32")
    sharding_plan = plan(zoo.build_mlp_block, MeshSpec((2, 4), ("batch", "model")), x)
    assert sharding_plan.estimate.budget_bytes is None
    assert sharding_plan.estimate.step_time_s is None

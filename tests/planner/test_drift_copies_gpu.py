"""The estimate of a plan whose storage cuts XLA:GPU carries into the
activations, against XLA:GPU's compiled peak, at real widths.

Two plans the planner made for Llama-2-70B on 16x16 (batch 256 x 4096,
`mixed_bfloat16`, for H100s, accumulating 2 micro-batches), kept here at 7
layers (`data/`):
- `scales_cut` stores each attention norm's scale cut over `model`: XLA:GPU
  holds the activations that layers not rematerialized keep cut over
  `model` (`stream_drift.held_as_partitioned`) and forms their weight
  gradients at the end of the backward pass from gathered copies, among
  them the forward pass's gathered norm outputs
  (`stream_drift.gathered_by_stage`). The estimate was 0.75 and 1.17 of the
  peaks at 3 and 7 layers before both were followed (0.92 and 1.00 with
  them). Its rematerialized layers recompute their norm outputs cut too
  and peak holding gathered copies inside their own backward passes: 0.95
  and 1.00 with those followed.
- `kernels_cut` stores the key kernels cut over `model` on their hidden
  dim (the norm scales whole), and here the value kernels as the keys (the
  planner stored them `(None, None, 'batch')`, which a pinned estimate
  reproduces as a cut: `reduced_depth.pinned_estimate`): the kept
  activations are held cut as well, but the norm outputs gathered in the
  forward pass are freed there. Counting those copies put the estimate at
  1.10 of the compiled peak of the planner's 80-layer plan and at 1.09 of
  this one's at 7 layers (0.99 without them), so this case is held to the
  real-size rows' 5 %.
Each is compiled deviceless for the mesh's 256 GPUs with its lower 2
layers rematerialized.
"""

import dataclasses
import json
import pathlib

import pytest

from benchmarks.peak_buffers import dump_options, read_dump, shapes_made_by
from keras_autoshard import ShardingPlan
from keras_autoshard.apply.jax.target_compile import compile_for_target
from keras_autoshard.building import build_abstract
from keras_autoshard.testing.real_size_models import TARGET, RealSizeRow
from keras_autoshard.testing.reduced_depth import pinned_estimate, restricted_plan

ROOT = pathlib.Path(__file__).parents[2]
CONFIG = ROOT / "examples" / "configs" / "llama2_70b.json"
PLANS = pathlib.Path(__file__).parent / "data"
REMATERIALIZED = 2


def _row() -> RealSizeRow:
    config = json.loads(CONFIG.read_text())
    return RealSizeRow("Llama-2-70B", "LlamaBackbone", config, (16, 16), 256, 4096)


@pytest.mark.parametrize(
    "plan_name, layers",
    [("scales_cut", 3), ("scales_cut", 7), ("kernels_cut", 7)],
)
def test_the_estimate_follows_what_xla_gpu_holds_cut_and_gathers(
    plan_name, layers, tmp_path
):
    row = _row()
    stored = ShardingPlan.load(str(PLANS / f"llama2_70b_16x16_{plan_name}.json"))
    specs = {v.path: v.spec for v in stored.variables}
    scales = [s for p, s in specs.items() if p.endswith("attention_layernorm/scale")]
    keys = [s for p, s in specs.items() if p.endswith("attention/key/kernel")]
    if plan_name == "scales_cut":  # the drift: a scale's, or a kernel's
        assert scales and all(spec == ("model",) for spec in scales)
    else:
        assert all(spec == (None,) for spec in scales)
        assert keys and all(spec[0] == "model" for spec in keys)
    assert stored.gradient_accumulation_steps == 2
    builder = row.builder(layers)
    paths = [v.path for v in build_abstract(builder).variables]
    shallow = dataclasses.replace(
        restricted_plan(stored, paths),
        rematerialize=tuple(f"transformer_layer_{i}" for i in range(REMATERIALIZED)),
    )
    estimate, _, differences = pinned_estimate(
        builder, shallow, row.sample_input(), TARGET
    )
    assert not differences
    shallow = dataclasses.replace(shallow, estimate=estimate)
    dump = dump_options(tmp_path)
    compiled = compile_for_target(
        builder,
        shallow,
        (row.sample_input(), row.sample_target()),
        TARGET,
        compiler_options=dump if (plan_name, layers) == ("scales_cut", 3) else None,
    )
    ratio = compiled.estimated_peak_bytes / compiled.compiled_peak_bytes
    bound = 0.05 if plan_name == "kernels_cut" else 0.10
    assert abs(ratio - 1) <= bound, ratio
    if (plan_name, layers) == ("scales_cut", 3):
        _assert_recomputed_cut_and_gathered(tmp_path)


def _assert_recomputed_cut_and_gathered(dump):
    """The rematerialized layers recompute their norm outputs cut over
    `model` as the kept ones are held (the hidden dim, 8192, a sixteenth:
    `[512, 8, 4096]` for a device's 8 x 4096 tokens) and gather whole
    `bfloat16` copies for the products that read them: the estimate counts
    the recomputed outputs cut (`stream_drift.held_as_partitioned`) and
    the copies held at the layer's peak (`stream_drift.gathered_by_stage`)."""
    _, hlo_text = read_dump(dump)
    recomputed = shapes_made_by(hlo_text, "rematted_computation/feedforward_layernorm")
    gathered = shapes_made_by(
        hlo_text,
        "checkpoint/rematted_computation/feedforward_gate_dense",
        "all-gather-done",
    )
    assert "bf16[512,8,4096]" in recomputed
    assert "bf16[8,4096,8192]" not in recomputed
    assert "bf16[8,4096,8192]" in gathered

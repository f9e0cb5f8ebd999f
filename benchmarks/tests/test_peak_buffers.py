"""What XLA:GPU holds at a zoo plan's compiled peak (`benchmarks/peak_buffers.py`):
the live-range dump read buffer by buffer, each named by its part of the
train step, on text written here and on zoo rows the estimate reads
off it."""

import pytest

LIVE_RANGE_TEXT = """HloLiveRange (max 9):
  InstructionSequence:
    0:param.3
    1:fusion.1
  BufferLiveRange:
    param.3{}:0-9
    fusion.1{}:1-6
    fusion.2{1}:3-8
    all-reduce-start{}:2-7
  Live ranges at 5 (peak):
    fusion.1{}: 4096 bytes (cumulative: 4096 bytes)
    all-reduce-start{}: 2048 bytes (cumulative: 6144 bytes)
    param.3{}: 1024 bytes (cumulative: 7168 bytes)
    fusion.2{1}: 512 bytes (cumulative: 7680 bytes)
  Stack trace breakdown for peak usage: 7 680 bytes
    main (100.0%, total: 7 680 bytes)
"""

HLO_TEXT = """HloModule jit_train_step

ENTRY %main (param.3: f32[16,64]) -> f32[] {
  %param.3 = f32[16,64]{1,0} parameter(0), metadata={op_name="state[2][1]"}
  %fusion.1 = f32[16,64]{1,0} fusion(%param.3), kind=kLoop, calls=%f, metadata={op_name="jit(train_step)/transpose(jvp(block_1))/dense/dot_general"}
  %all-reduce-start = f32[512]{0} all-reduce-start(%fusion.1), to_apply=%add
  %fusion.2 = (f32[4]{0}, f32[128]{0}) fusion(%param.3), kind=kLoop, calls=%g, metadata={op_name="jit(train_step)/jvp(block_0)/norm/mul"}
  ROOT %r = f32[] constant(0)
}
"""  # noqa: E501


def test_the_peak_buffers_are_read_with_their_ranges_and_parts():
    from benchmarks.peak_buffers import read_peak_buffers

    peak = read_peak_buffers(LIVE_RANGE_TEXT, HLO_TEXT)
    assert (peak.position, peak.length, peak.total_bytes) == (5, 9, 7680)
    rows = [
        (b.name, b.size_bytes, b.first, b.last, b.part, b.layer, b.opcode)
        for b in peak.buffers
    ]
    assert rows == [
        ("fusion.1{}", 4096, 1, 6, "backward", "block_1", "fusion"),
        ("all-reduce-start{}", 2048, 2, 7, "other", "", "all-reduce-start"),
        ("param.3{}", 1024, 0, 9, "optimizer state", "", "parameter"),
        ("fusion.2{1}", 512, 3, 8, "forward", "block_0", "fusion"),
    ]
    assert peak.by_part() == {
        "backward": 4096,
        "other": 2048,
        "optimizer state": 1024,
        "forward": 512,
    }


def test_a_dump_with_no_peak_section_is_an_error():
    from benchmarks.peak_buffers import read_peak_buffers

    with pytest.raises(ValueError, match="peak"):
        read_peak_buffers(LIVE_RANGE_TEXT.split("  Live ranges")[0])


def test_the_zoo_mlp_on_1x8_peaks_with_both_layers_weight_gradient_partials_live():
    """The zoo MLP on 1x8 peaks in mlp_up's backward pass holding both
    layers' weight gradients in split partials (16 x a 128 x 64 kernel
    shard in float32, 512 KiB each): mlp_down's are made first and read by
    its update, which XLA:GPU runs after mlp_up's are made. The estimate
    held one layer's at a time (`split_k.merged_split_gradient_bytes`),
    0.89 of the compiled peak; it holds both now
    (`accelerator_peak._update_read_partials`): 1.03."""
    from benchmarks.peak_buffers import read_by_the_update, zoo_peak_buffers

    result = zoo_peak_buffers("mlp", "1x8", "float32")
    peak = result["peak"]
    largest = peak.buffers[:2]
    assert sorted((b.part, b.layer, b.size_bytes) for b in largest) == [
        ("backward", "mlp_down", 16 * 64 * 128 * 4),
        ("backward", "mlp_up", 16 * 128 * 64 * 4),
    ]
    down = next(b for b in largest if b.layer == "mlp_down")
    up = next(b for b in largest if b.layer == "mlp_up")
    assert down.first < up.first == peak.position < down.last
    assert read_by_the_update(result["hlo_text"], down.name)
    estimate = result["plan"].estimate.peak_bytes
    assert estimate == pytest.approx(result["compiled_peak"], rel=0.05)
    # The peak's buffers are the compiled peak less what XLA:GPU counts
    # beside them (the arguments it does not hold at the peak, alignment):
    # 1.85 of 1.98 MiB here.
    assert 0.9 * result["compiled_peak"] <= peak.total_bytes <= result["compiled_peak"]


def test_a_rematerialized_layer_recomputes_its_norm_outputs_cut_where_scales_are():
    """The zoo's subclassed model on 2x4 under 75 % of its free peak stores
    its LayerNorm scales and offsets cut over `model` (a stream drift,
    `stream_drift.held_as_partitioned`) and rematerializes both blocks:
    XLA:GPU recomputes each norm's output cut over `model` (its 128-wide
    hidden dim a quarter, `[32, 4, 64]` for a device's 4 x 64 tokens) and
    gathers whole copies for the products that read it, but holds none at
    its peak (inside block 1's backward pass, where its feed-forward
    products, its last, form their gradients): each forward copy is freed
    after its product, and those for the weight gradients are gathered
    after the peak. The estimate counts the recomputed outputs cut and no
    copy there (`stream_drift.gathered_by_stage`): 1.07 of the compiled
    peak (1.15 when it counted them whole)."""
    from benchmarks.peak_buffers import shapes_made_by, zoo_peak_buffers

    result = zoo_peak_buffers(
        "subclassed", "2x4", "float32, budget 75% of the free peak"
    )
    scales = [v.spec for v in result["plan"].variables if v.path.endswith("/gamma")]
    assert scales and all(spec == ("model",) for spec in scales)
    # Both blocks' calls (Keras numbers their names per process).
    rematerialized = result["plan"].rematerialize
    assert len(rematerialized) == 2
    assert all(name.startswith("self_attention_block") for name in rematerialized)
    whole = "f32[4,64,128]"
    hlo_text = result["hlo_text"]
    recomputed = shapes_made_by(hlo_text, "rematted_computation/layer_normalization")
    gathered = shapes_made_by(hlo_text, "rematted_computation/dense", "all-gather-done")
    assert "f32[32,4,64]" in recomputed and whole not in recomputed
    assert whole in gathered
    at_peak = {
        b.opcode for b in result["peak"].buffers if b.size_bytes == 4 * 64 * 128 * 4
    }
    assert not any(opcode.startswith("all-gather") for opcode in at_peak)
    estimate = result["plan"].estimate.peak_bytes
    assert estimate == pytest.approx(result["compiled_peak"], rel=0.10)

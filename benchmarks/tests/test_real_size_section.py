"""The real-size XLA:GPU benchmark's rows and section: each row's target
has its backbone's output shape, and the section labels what it
extrapolated and what was not measured (`benchmarks/real_size_gpu.py`,
`real_size_report.py`). The compiles themselves run only in the benchmark."""

import keras_autoshard as ka
from benchmarks.real_size_gpu import (
    COMMAND,
    FULL_COMPILE_RSS_LIMIT_BYTES,
    FULL_COMPILE_TIMEOUT_S,
    TARGET,
    real_size_rows,
)
from benchmarks.real_size_report import render


def test_each_rows_target_has_its_backbones_output_shape():
    for row in real_size_rows():
        model = ka.build_abstract(row.builder(2))
        _, tokens_dim, width = model.outputs[0].shape
        target = row.sample_target().shape
        # A sequence model's token dim is free; an image model's is fixed.
        assert tokens_dim in (None, target[1]) and width == target[2], row.name
        assert target[:2] == (row.batch, row.seq)


def _compile(layers, peak, estimate):
    return {
        "layers": layers,
        "compiled_peak_bytes": peak,
        "estimated_peak_bytes": estimate,
        "compile_s": 1.0 + layers,
        "rss_bytes": 2**30,
        "rematerialized": layers,
        "estimate_plan_differences": [],
    }


def test_the_section_labels_extrapolated_peaks_and_what_was_not_measured():
    rows = [r for r in real_size_rows() if r.published][:2]
    estimate = {"peak_bytes": 70 * 2**30, "step_time_s": 4.0}
    base = {
        "planning_s": 12.0,
        "planning_rss_bytes": 2**30,
        "estimate": estimate,
        "rematerialized": 80,
        "accumulation": 2,
    }
    gib = 2**30
    extrapolated = dict(
        base,
        compiles=[_compile(n, (10 + n) * gib, (12 + n) * gib) for n in (2, 4, 8)],
        full_compile=None,
        predicted_full_rss_bytes=4 * gib,
        skipped=["80 layers: no result within 900 s"],
    )
    measured = dict(
        base,
        rematerialized=75,
        compiles=[_compile(2, 12 * gib, 14 * gib)],
        full_compile=_compile(80, 90 * gib, 0),
        skipped=["4 layers: no result within 1800 s"],
    )
    text = render(
        rows,
        [extrapolated, measured],
        "a machine",
        COMMAND,
        TARGET,
        FULL_COMPILE_TIMEOUT_S,
        FULL_COMPILE_RSS_LIMIT_BYTES,
    )
    assert COMMAND in text
    # 10 GiB + 1 GiB per layer, at 80 layers: 90 GiB, marked as the fit's.
    assert "90.00 GiB (extrapolated from 2, 4, 8 layers)" in text
    assert "80, extrapolated (a + b × layers)" in text
    assert "80 layers: no result within 900 s" in text
    assert "| NO |" in text  # 90 GiB compiled is over the usable 76 GiB
    assert "4 layers: no result within 1800 s" in text
    assert "the full plan rematerializes 75 of 80 layers" in text
    # 256 × 4096 tokens in 4 s on 256 GPUs: 1,024 tokens/s per GPU.
    assert "| 1,024 | 829–876 | 1.17–1.24 |" in text

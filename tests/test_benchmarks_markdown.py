"""`write_section` rewrites one named section of BENCHMARKS.md and keeps the rest."""

import os

import pytest

from benchmarks.markdown import (
    end_marker,
    markdown_table,
    read_section,
    start_marker,
    write_section,
)


def _read(path) -> str:
    return path.read_text(encoding="utf-8")


def test_missing_file_is_created_with_preamble_and_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(str(path), "strategies", "## Strategies\n\nrow 1", preamble="# B\n")
    text = _read(path)
    assert text.startswith("# B\n")
    assert read_section(text, "strategies") == "## Strategies\n\nrow 1"
    assert text.index(start_marker("strategies")) < text.index(end_marker("strategies"))


def test_new_section_is_appended_after_existing_ones(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(str(path), "strategies", "strategies v1")
    write_section(str(path), "planner", "planner v1")
    text = _read(path)
    assert read_section(text, "strategies") == "strategies v1"
    assert read_section(text, "planner") == "planner v1"
    assert text.index(end_marker("strategies")) < text.index(start_marker("planner"))


def test_replacing_one_section_keeps_the_others_and_outside_text(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(str(path), "strategies", "strategies v1")
    write_section(str(path), "planner", "planner v1")
    write_section(str(path), "planning-70b", "70b v1")
    with open(path, "a", encoding="utf-8") as f:
        f.write("\nHand-written closing note.\n")
    before = _read(path)

    write_section(str(path), "planner", "planner v2\nwith two lines")

    after = _read(path)
    assert read_section(after, "planner") == "planner v2\nwith two lines"
    assert read_section(after, "strategies") == "strategies v1"
    assert read_section(after, "planning-70b") == "70b v1"
    assert after.endswith("\nHand-written closing note.\n")
    # Everything outside the replaced section is byte-for-byte unchanged.
    prefix = before[: before.index(start_marker("planner"))]
    assert after.startswith(prefix)
    suffix = before[before.index(end_marker("planner")) :]
    assert after.endswith(suffix)


def test_rewriting_a_section_with_the_same_content_is_idempotent(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(str(path), "strategies", "table")
    first = _read(path)
    write_section(str(path), "strategies", "table")
    assert _read(path) == first


def test_malformed_section_markers_are_an_error(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(f"# B\n\n{start_marker('planner')}\nno end marker\n")
    with pytest.raises(ValueError, match="malformed"):
        write_section(str(path), "planner", "new")


def test_section_names_with_marker_syntax_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="not allowed"):
        write_section(str(tmp_path / "B.md"), "bad -->", "x")


def test_markdown_table_escapes_pipes_and_aligns_numbers():
    table = markdown_table(["name", "bytes"], [["a|b", "4"]], [False, True])
    assert table.splitlines() == [
        "| name | bytes |",
        "| --- | ---: |",
        "| a\\|b | 4 |",
    ]


def _gpu_row(model, mesh, policy, estimated, compiled, collectives, **extra):
    return {
        "model": model, "mesh": mesh, "policy": policy,
        "dtype_policy": policy.split(",")[0], "rematerialize": "auto",
        "budget_share": None, "levers": "none", "compiler": "XLA:GPU",
        "estimated_peak": estimated, "compiled_peak": compiled,
        "collectives_by_axes": collectives, "collectives_by_kind": {},
        "layout": f"{model} {mesh}", **extra,
    }  # fmt: skip


def test_gpu_memory_truth_names_rows_outside_the_bound_and_planner_above_megatron():
    from benchmarks.memory_truth_gpu import render

    zoo_rows = [
        _gpu_row("gpt2", "2x4", "float32", 1000, 1050, {"batch": 100, "model": 300}),
        _gpu_row("llama", "2x4", "float32", 700, 1000, {"batch": 100, "model": 500}),
        _gpu_row("llama", "2x4", "float32, remat all", 1200, 1000, {"model": 1},
                 rematerialize="all"),
        {"model": "llama", "mesh": "2x4", "policy": "float32, budget 70% of the "
         "free peak", "dtype_policy": "float32", "rematerialize": "auto",
         "budget_share": 0.7, "plan_error": "No plan fits the per-device budget "
         "of 7 MiB: the least peak found, on batch=2 x model=4, is 8 MiB, over "
         "by 1.00 MiB (parameters 1 MiB)."},
    ]  # fmt: skip
    megatron_rows = [
        {"model": "gpt2", "mesh": "2x4", "planner_layout": "gpt2 2x4",
         "same_layout": True},
        {"model": "llama", "mesh": "2x4", "planner_layout": "llama 2x4",
         "same_layout": False, "compiled_peak": 900,
         "collectives_by_axes": {"batch": 100, "model": 400},
         "collectives_by_kind": {"reduce-scatter": 10}},
    ]  # fmt: skip
    text = render(zoo_rows, megatron_rows, "python -m x", "this machine", 120)
    assert "3 rows compiled: 0.70 to 1.20 (1 of 3 within ±10%)" in text
    assert "under the compiled peak on 2 of 3 rows." in text
    assert (
        "(ratios before rounding), farthest first: llama 2x4 float32 (0.70); "
        "llama 2x4 float32, remat all (1.20)." in text
    )
    assert "rematerializing 1.20 to 1.20 (0 of 1 within ±10%)" in text
    assert "over by 1.00 MiB." in text and "(parameters" not in text
    assert "| llama | 2x4 | float32, budget 70% of the free peak | no plan |" in text
    assert "at most the hand-written layout's on 1 of 2 rows." in text
    assert "hand-written one on gpt2 2x4." in text
    assert "The planner above the hand-written layout: llama 2x4 (1.20)." in text
    assert "Compiles with reduce-scatters: hand-written llama 2x4." in text
    assert (
        "| llama | 2x4 | no | 100 B | 500 B | 600 B | 100 B | 400 B | 500 B |" in text
    )
    assert "took 2 minutes" in text and "python -m x" in text


def test_the_device_step_section_is_what_its_committed_results_render():
    # The GPU figures regenerate here, without a GPU, from the JSON the
    # device run wrote (committed beside the script).
    import json

    from benchmarks import device_step, device_step_report
    from benchmarks.markdown import read_section

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    for path in device_step.RESULTS:
        with open(os.path.join(root, path)) as file:
            results.append(json.load(file))
    with open(os.path.join(root, "BENCHMARKS.md")) as file:
        published = read_section(file.read(), device_step.SECTION_NAME)
    assert published.strip() == device_step_report.render(results).strip()
    for result in results:
        assert result["gpu"]["kind"] == "NVIDIA H200"
        assert device_step.profile_for(result["gpu"]["kind"]) == result["profile"]

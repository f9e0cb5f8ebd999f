"""`write_section` rewrites one named section of BENCHMARKS.md and keeps the rest."""

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


def test_gpu_memory_truth_renders_each_variant_and_names_rows_outside(tmp_path):
    import json

    from benchmarks.memory_truth_gpu import VARIANTS, _axes, _spec, render

    # A spec's tuples of axes survive the trip through JSON.
    spec = ("batch", None, ("batch", "model"))
    assert tuple(map(_axes, json.loads(json.dumps(_spec(spec))))) == spec
    estimate = {"peak_bytes": 1000}
    cases = [
        {"model": "a", "mesh": "2x4", "policy": "float32", "estimate": estimate,
         "levers": "none"},
        {"model": "b", "mesh": "1x8", "policy": "float32, remat all",
         "estimate": estimate, "levers": "remat 2 layers"},
    ]  # fmt: skip
    peaks = {"default": (1000, 2000), "estimate_limit": (1000, 800),
             "memory_scheduler": (950, 1000)}  # fmt: skip
    results = {
        str(i): {v: {"peak": peaks[v][i], "jax": "0.11.2"} for v in VARIANTS}
        for i in range(2)
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "gpu_results.json").write_text(json.dumps(results))
    text = render(str(tmp_path), "python -m benchmarks.memory_truth_gpu render")
    assert "- defaults: 0.50 to 1.00 (1 of 2 within ±15 %)" in text
    assert "rematerializing rows 1.25 to 1.25 (0 of 1 within ±15 %)" in text
    assert "with the estimate as limit: b 1x8 float32, remat all (1.25)." in text
    assert "jax 0.11.2" in text

"""`write_section` rewrites one named section of BENCHMARKS.md and keeps the rest."""

import pytest

from keras_autoshard.testing.markdown import (
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

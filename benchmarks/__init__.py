"""Benchmarks for keras-autoshard; `python -m benchmarks.run_benchmarks` runs them.

Each script writes its results into one named section of `BENCHMARKS.md`
(see `keras_autoshard.testing.markdown.write_section`), so scripts never overwrite each
other's results.
"""

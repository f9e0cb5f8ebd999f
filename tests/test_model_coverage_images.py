"""The vision, audio and multimodal Backbone classes of keras_hub 0.32.0,
checked as `tests/test_model_coverage.py` checks the text classes (its
docstring says how); a file of their own so that the suite's two workers
share the sweep."""

import pytest

from tests.test_model_coverage import checks, run_check


@pytest.mark.slow
@pytest.mark.parametrize("class_name, check", checks(text=False))
def test_backbone_plans_and_matches_one_device(class_name, check):
    """`check` is a mesh (forward parity, batch split); they run class by
    class so that each class is built once."""
    run_check(class_name, check)

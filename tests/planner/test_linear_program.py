"""The solver's status and optimality gap, recorded in the plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from keras_autoshard.errors import InfeasibleError, PlanError, SolverTimeLimitError
from keras_autoshard.planner.linear_program import (
    TIME_LIMIT_GROWTH,
    TIME_LIMIT_RETRIES,
    LinearProgram,
)
from keras_autoshard.plans.estimate import PlanEstimate


def _knapsack(items: int = 60, rows: int = 5) -> LinearProgram:
    """A 0-1 knapsack of several constraints whose relaxation is
    fractional: HiGHS needs more than its root node to prove it."""
    rng = np.random.default_rng(1)
    weights = rng.integers(20, 80, (rows, items))
    values = rng.integers(20, 80, items)
    lp = LinearProgram()
    xs = [lp.add_var(cost=-float(v), integer=True) for v in values]
    for row in weights:
        lp.add_row({x: float(w) for x, w in zip(xs, row)}, upper=row.sum() / 2.7)
    return lp


def test_a_solve_proved_optimal_says_so():
    lp = _knapsack()
    lp.solve()
    assert lp.outcome.status == "optimal"
    assert lp.outcome.gap is not None and lp.outcome.gap <= 1e-6
    assert lp.outcome.describe().startswith("optimal")


def test_a_search_stopped_at_its_node_limit_says_so_with_its_gap():
    lp = _knapsack()
    lp.solve(node_limit=1)
    assert lp.outcome.status == "node limit"
    assert lp.outcome.gap is not None and lp.outcome.gap > 1e-6
    words = lp.outcome.describe()
    assert "node limit" in words and "optimality gap" in words


def test_the_plan_keeps_it_in_json_and_explain(tmp_path):
    import keras_autoshard as ka
    from keras_autoshard.plans.sharding_plan import ShardingPlan
    from keras_autoshard.testing import zoo

    build, batch = zoo.ZOO["mlp"]
    plan = ka.plan(build, ka.MeshSpec((2, 4), ("batch", "model")), batch())
    assert plan.estimate.search.startswith("optimal")
    assert f"search: {plan.estimate.search}" in plan.explain()
    data = json.loads(plan.to_json())
    assert data["estimate"]["search"] == plan.estimate.search
    back = ShardingPlan.from_json(plan.to_json())
    assert back.estimate.search == plan.estimate.search
    # A plan written before the field reads back without it.
    del data["estimate"]["search"]
    assert PlanEstimate.from_dict(data["estimate"]).search is None


def test_a_solve_out_of_time_with_no_solution_is_not_called_infeasible():
    """A program stopped by its wall-clock limit before any solution is
    solved again with a longer limit, then reported as out of time (a
    `PlanError` that says so), never as infeasible: the same program has
    a solution (solved without the limit below). Planning Llama-2-70B on
    16x16 once read a 20 s limit reached on a loaded machine as "nothing
    fits"."""
    lp = _knapsack()
    with pytest.raises(SolverTimeLimitError) as error:
        lp.solve(time_limit_s=1e-5)
    assert not isinstance(error.value, InfeasibleError)
    assert isinstance(error.value, PlanError)
    limit = 1e-5 * TIME_LIMIT_GROWTH**TIME_LIMIT_RETRIES
    assert f"no plan within {limit:.3g} s" in str(error.value)
    assert "does not show that nothing fits" in str(error.value)
    values = _knapsack().solve()
    assert values.sum() > 0

"""The solver's status and optimality gap, recorded in the plan."""

from __future__ import annotations

import json

import numpy as np

from keras_autoshard.planner.linear_program import LinearProgram
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
    from benchmarks import zoo
    from keras_autoshard.plans.sharding_plan import ShardingPlan

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

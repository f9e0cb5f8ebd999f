"""Planner: cost model and exact search from an axis graph to a ShardingPlan."""

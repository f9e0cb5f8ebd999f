"""Axis graph: which tensor axes must share a sharding (backend-neutral)."""

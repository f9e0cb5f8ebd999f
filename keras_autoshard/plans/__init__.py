"""Sharding plans: plain data describing how each tensor is cut over a mesh."""

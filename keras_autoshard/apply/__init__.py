"""Carry out a plan: Keras distributions that serve its layouts."""

"""Test set-up: JAX backend and 8 simulated host devices, before JAX starts."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

simulate_devices(8)

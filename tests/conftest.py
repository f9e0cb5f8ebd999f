"""Test set-up: JAX backend and 8 simulated host devices, before JAX starts,
compiling at the suite's code-generation level (`tests/xla_flags.py`);
compiled programs shared within the run; a deprecation this package's code
triggers fails the test.

XLA programs that the suite compiles more than once (the same model's step
on the same devices, in several tests and test files) are compiled once:
JAX's compilation cache is pointed at a directory made for this run by the
first process that loads this file (pytest's own, or its only worker) and
removed when that process ends; the xdist workers it starts inherit it
through `KERAS_AUTOSHARD_TEST_XLA_CACHE`. Subprocesses that the tests start
(torchrun ranks, `jax.distributed` processes) compile on their own. It
changes no result: a cached executable is the one the compiler made for the
same program and options.
"""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tests.xla_flags import with_suite_flags  # noqa: E402

os.environ["XLA_FLAGS"] = with_suite_flags(os.environ.get("XLA_FLAGS", ""))

from keras_autoshard.runtime.devices import simulate_devices  # noqa: E402

simulate_devices(8)

import jax  # noqa: E402

_COMPILED = os.environ.get("KERAS_AUTOSHARD_TEST_XLA_CACHE")
if _COMPILED is None:
    _COMPILED = tempfile.mkdtemp(prefix="keras_autoshard_tests_xla_")
    os.environ["KERAS_AUTOSHARD_TEST_XLA_CACHE"] = _COMPILED
    atexit.register(shutil.rmtree, _COMPILED, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILED)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# A DeprecationWarning attributed to this package's code (the warnings module
# names the module of the frame the warning's stack level points at: ours,
# for a deprecated JAX, Keras, Orbax or NumPy API we call that warns at its
# caller) fails the test. As a mark it is applied after pytest's -W options,
# so `-W ignore::DeprecationWarning` does not hide it; a test's own
# filterwarnings mark still overrides it.
OWN_DEPRECATIONS_FAIL = pytest.mark.filterwarnings(
    r"error::DeprecationWarning:keras_autoshard(\.|$)"
)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(OWN_DEPRECATIONS_FAIL, append=False)


_CPU_LOG_PATH = os.environ.get("KERAS_AUTOSHARD_CPU_LOG")
if _CPU_LOG_PATH:
    from tests.cpu_log import CpuLog

    _CPU_LOG = CpuLog(_CPU_LOG_PATH)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """CPU seconds per test into `KERAS_AUTOSHARD_CPU_LOG` (`tests/cpu_log.py`)."""
        before = _CPU_LOG.counters()
        yield
        _CPU_LOG.write(item.nodeid, before, _CPU_LOG.counters())

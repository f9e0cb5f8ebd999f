#!/usr/bin/env bash
# keras-autoshard developer entry point. Creates (or reuses) .venv on Python
# 3.11, installs the project with the extras it needs at the exact versions of
# dev-lock.txt, then runs the demo or the test suite.
#   bash dev.sh demo [demo options]   # shard a KerasHub GPT-2 over 8 devices
#   bash dev.sh test [pytest options] # the whole test suite
#   bash dev.sh matrix [set ...]      # compatibility run (oldest, py312,
#                                     # newest, nightly; see COMPATIBILITY.md)
#   bash dev.sh lock                  # rewrite dev-lock.txt from .venv
# The suite runs in 2 worker processes (pytest-xdist, a test file per worker
# at a time: module fixtures are built once), as many as CI's 2 cores; set
# KERAS_AUTOSHARD_TEST_WORKERS to change that, or pass -n 0 to run in this
# process.
set -euo pipefail
cd "$(dirname "$0")"

venv=.venv
extras="hub,checkpoint,plot,dev,torch,gpu-compile"
lock=dev-lock.txt
stamp="$venv/.installed-$(cat pyproject.toml "$lock" | sha256sum | cut -c1-16)-$extras"

if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -c "$lock" -e ".[$extras]"
  rm -f "$venv"/.installed-*
  touch "$stamp"
fi

export KERAS_BACKEND="${KERAS_BACKEND:-jax}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
command="${1:-}"
shift || true
case "$command" in
  demo) exec "$venv/bin/python" -m keras_autoshard demo "$@" ;;
  # The suite needs no accelerator: JAX on the CPU only (the CUDA plugin of
  # the gpu-compile extra compiles for GPUs without one, and stays quiet).
  test)
    export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
    exec "$venv/bin/python" -m pytest -q -W ignore::DeprecationWarning \
    -n "${KERAS_AUTOSHARD_TEST_WORKERS:-2}" --dist loadfile "$@" ;;
  matrix) exec "$venv/bin/python" -m tools.compat_matrix "$@" ;;
  lock)
    {
      sed -n '1,/^# Regenerate/p' "$lock"
      "$venv/bin/python" -m pip freeze --all --exclude-editable \
        | grep -v '^pip==' | sed 's/+cpu$//'
    } > "$lock.new"
    mv "$lock.new" "$lock" ;;
  *) echo "usage: bash dev.sh {demo|test|matrix|lock} [options]" >&2; exit 2 ;;
esac

#!/bin/sh
# PYTHON_EXEC for the compat suite: marks the environment, then runs the real interpreter.
COMPAT_PYTHON_EXEC=used exec "$COMPAT_REAL_PYTHON" "$@"

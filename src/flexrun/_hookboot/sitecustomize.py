"""flexrun's worker boot hook (see :mod:`flexrun.worker_hook`): not a module to import.

The agent puts this directory first on a worker's ``PYTHONPATH``; ``site`` imports this
file before the script runs. It takes itself out of ``sys.path`` and ``PYTHONPATH`` (the
script sees torchrun's), installs the progress hook, and then runs the user's own
``sitecustomize``, if one is on the path, as Python would have.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_orig = os.environ.pop("FLEXRUN_ORIG_PYTHONPATH", None)
if _orig is not None:
    os.environ["PYTHONPATH"] = _orig[1:]
elif os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] == _here:
    os.environ.pop("PYTHONPATH")

try:
    from flexrun.worker_hook import install

    install()
except ImportError as exc:  # (flexrun is not importable by this interpreter)
    print(f"flexrun: worker progress hook not installed: {exc}", file=sys.stderr)

_me = sys.modules.pop("sitecustomize")
try:
    import sitecustomize  # noqa: F401  (the user's, now that this one is off the path)
except ImportError as exc:
    sys.modules["sitecustomize"] = _me  # (importlib expects a module under the name)
    if exc.name != "sitecustomize":
        raise

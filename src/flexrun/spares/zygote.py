"""The fork server of warm spares: ``python -m flexrun.spares.zygote``.

Owns only what makes the zygote warm: the spare's imports (Python, torch,
``flexrun.train``, through :mod:`flexrun.spares.spare`), paid once here and inherited by
every spare it forks. The loop (requests, forks, reaping) is
:func:`flexrun.spares.forks.serve_forks`; the pool's side is
:mod:`flexrun.spares.forkserver`.
"""

from __future__ import annotations

import sys

from flexrun.spares.forks import serve_forks
from flexrun.spares.spare import _prepare  # (imports torch: the point of a zygote)


def main() -> int:
    return serve_forks(prepare=_prepare)


if __name__ == "__main__":
    sys.exit(main())

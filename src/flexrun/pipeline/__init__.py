"""flexrun.pipeline: a stage graph run locally (cached, resumable) or rendered for Argo.

Owns the pipeline spec (``spec``), the local runner and its state file (``runner``,
``state``), model versioning (``versions``) and the Argo Workflow emitter (``argo``).
It does not launch training itself: the train stage runs ``flexrun run`` as a process.
"""

from __future__ import annotations

"""The elastic agent of one node: rendezvous -> run the workers -> react.

Owns composing the layers below for one node: :mod:`.agent` (the loop, signals, store
outages, exit codes), :mod:`.policy` (pure: what a failure means), the two runners behind
:mod:`.runner`'s protocol (:mod:`.restart`: torchrun semantics; :mod:`.live` and
:mod:`.live_epochs`: survivors keep their processes), :mod:`.spec` (the worker
environment contract) and :mod:`.launch` (config -> store -> agent). Processes are
:mod:`flexrun.proc`'s, warm interpreters :mod:`flexrun.spares`', membership
:mod:`flexrun.rendezvous`'.
"""

from flexrun.agent.agent import Agent

__all__ = ["Agent"]

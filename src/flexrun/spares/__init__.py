"""Warm interpreters: processes with Python and torch imported before they are needed.

Owns every kind of them and everything between their processes, below the agent and the
CLI (it imports neither; only the spare's entry point imports :mod:`flexrun.train`, to
pay for it ahead of need):

- :mod:`.pool`: an agent's own spares (:class:`~.pool.WarmPool`, :func:`~.pool.assign`);
- :mod:`.daemon` and :mod:`.listener`: a node's ``flexrun spares`` that outlives agents;
- :mod:`.client`: taking from that daemon (spares, its status, a warm agent);
- :mod:`.adopted`: the handle of a process taken but not started;
- :mod:`.protocol`: names, request and reply shapes, exit records (torch-free);
- :mod:`.trust`: this user only (directory owner and mode, ``SO_PEERCRED``);
- :mod:`.become` and :mod:`.lifeline`: the receiving side of a hand-over, dying with the
  owner, signals, exit codes;
- :mod:`.forks` and :mod:`.forkserver`: a pool's fork server (zygote), which pays the
  imports once and forks each spare, and the pool's side of it;
- :mod:`.spare`: a spare's entry point (``python -m flexrun.spares.spare``, with
  ``--fork-server`` the zygote's). The warm
  agent's entry point is :mod:`flexrun.warm_agent` (it runs the CLI, which sits above).

Imports nothing at package import, so a spare's start pays only for what it uses.
"""

"""Integrations of ``flexrun.train`` with the training libraries' own loops.

Owns nothing by itself: each submodule (``hf`` for Hugging Face ``Trainer``, ``lightning``
for Lightning) imports its library when it is imported, never before, so ``import flexrun``
costs nothing for scripts that use neither.
"""

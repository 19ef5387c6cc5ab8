"""A package for the module-mode cases (``-m probepkg.main``)."""

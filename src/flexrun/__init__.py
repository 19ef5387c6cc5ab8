"""flexrun: elastic, fault-tolerant PyTorch distributed training.

The launcher is ``flexrun run`` (see ``flexrun.cli``); training scripts import
``flexrun.train``. This module exports only the version and the error tree.
"""

from flexrun.errors import FlexrunError

__version__ = "0.1.0"

__all__ = ["FlexrunError", "__version__"]

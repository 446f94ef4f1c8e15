"""The published contract (DESIGN.md, "Contract: ``lightning_rl.losses``"): every loss, advantage, penalty and
importance-weight function under its contract name, importable from here whatever layer defines it.

The functions live in the maths layer (``lightning_rl.maths``: ``losses``, ``advantages``, ``aggregation``,
``trust_regions``, ``ratio_levels``, ``preference_losses``); code inside the package imports them from
there, users and the contract tests from here.
"""

import lightning_rl.maths.losses as maths_losses
from lightning_rl.maths.losses import *  # noqa: F403

__all__ = list(maths_losses.__all__)

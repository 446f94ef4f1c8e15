"""The project's exception types, in one leaf module that imports nothing from the package, so that every
layer (and the ``data`` and ``callbacks`` plugins) can raise them without importing the layer that prints
them.

* :class:`InputError`: the data or the model does not fit the config, found while setting up ``fit``.
* :class:`ConfigError`: a run that cannot start (a value its classes reject, a checkpoint that is missing,
  unreadable or of another batch geometry).

``lightning-rl`` (``lightning_rl.cli.main.main``) prints either as one ``lightning-rl: error: ...`` line and
exits with status 1. Lower layers name the field; the option group or the CLI adds the YAML prefix.
"""

from __future__ import annotations


class InputError(ValueError):
    """The data or the model does not fit the config, found while setting up ``fit`` (before any step)."""


class ConfigError(ValueError):
    """A run that cannot start: a value its classes reject, or a checkpoint that is missing or unreadable.

    Raised before training begins; ``main`` prints it as one line and exits with status 1.
    """

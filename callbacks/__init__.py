"""Lightning callbacks of lightning-rl, installed as ``lightning_rl.callbacks``."""

# the folder sits at the repo root; its name belongs to others on PyPI
if __name__ != "lightning_rl.callbacks":
    raise ImportError(
        f"this package is `lightning_rl.callbacks`; it was imported as `{__name__}`. "
        "Install lightning-rl (`pip install -e .`) and import `lightning_rl.callbacks`."
    )

from lightning_rl.callbacks.base import RLCallback  # noqa: E402
from lightning_rl.callbacks.checkpoints import Checkpoints  # noqa: E402
from lightning_rl.callbacks.export import ExportPolicy  # noqa: E402
from lightning_rl.callbacks.geometry import BatchGeometry  # noqa: E402
from lightning_rl.callbacks.interrupt import CheckpointOnInterrupt  # noqa: E402
from lightning_rl.callbacks.predictions import WritePredictions  # noqa: E402
from lightning_rl.callbacks.samples import LogSamples  # noqa: E402
from lightning_rl.callbacks.steps import LogAtOptimizerStep, StepProgressBar  # noqa: E402

__all__ = [
    "BatchGeometry",
    "CheckpointOnInterrupt",
    "Checkpoints",
    "ExportPolicy",
    "LogAtOptimizerStep",
    "LogSamples",
    "RLCallback",
    "StepProgressBar",
    "WritePredictions",
]

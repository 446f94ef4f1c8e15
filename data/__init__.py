"""DataModules, built-in tasks and the embedded tiny model, installed as ``lightning_rl.data``."""

if __name__ != "lightning_rl.data":  # the folder sits at the repo root; `data` is a common top-level name
    raise ImportError(
        f"this package is `lightning_rl.data`; it was imported as `{__name__}`. "
        "Install lightning-rl (`pip install -e .`) and import `lightning_rl.data`."
    )

from lightning_rl.data.calc_task import MultiplyTask  # noqa: E402
from lightning_rl.data.curriculum import Curriculum  # noqa: E402
from lightning_rl.data.preference import PreferenceDataModule  # noqa: E402
from lightning_rl.data.prompts import PromptDataModule  # noqa: E402
from lightning_rl.data.sort_task import SortTask  # noqa: E402

__all__ = ["Curriculum", "MultiplyTask", "PreferenceDataModule", "PromptDataModule", "SortTask"]

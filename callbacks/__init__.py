"""Lightning callbacks of lightning-rl, installed as ``lightning_rl.callbacks``."""

if __name__ != "lightning_rl.callbacks":  # the folder sits at the repo root; its name belongs to others on PyPI
    raise ImportError(
        f"this package is `lightning_rl.callbacks`; it was imported as `{__name__}`. "
        "Install lightning-rl (`pip install -e .`) and import `lightning_rl.callbacks`."
    )

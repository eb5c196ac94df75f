"""lmforge: train small language and reasoning models from scratch, then serve and export them."""

__version__ = "0.2.0"

from lmforge.errors import LMForgeError  # noqa: E402

__all__ = ["LMForgeError", "__version__"]

"""Export trained models to other tools' formats (``lmforge export``)."""

from lmforge.export.gguf import GGUF_DTYPES, export_gguf
from lmforge.export.hf import export_hf

__all__ = ["export_hf", "export_gguf", "GGUF_DTYPES"]

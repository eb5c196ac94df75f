"""Export trained models to other tools' formats (``lmforge export``)."""

from lmforge.export.hf import export_hf

__all__ = ["export_hf"]

"""Corpus to training tokens: read sources, filter, deduplicate, split, tokenize, pack and load.

``prepare_data`` writes a self-contained data directory; ``TokenDataset`` and ``PackedLoader`` read it.
"""

from lmforge.data.loader import PackedLoader, TokenDataset, read_meta
from lmforge.data.prepare import prepare_data, train_tokenizer_from_sources
from lmforge.data.sources import Document, FilterStats, iter_documents

__all__ = ["Document", "FilterStats", "PackedLoader", "TokenDataset", "iter_documents", "prepare_data",
           "read_meta", "train_tokenizer_from_sources"]

"""Exact and near-duplicate detection; the first occurrence of a document always wins.

Exact: a 128-bit BLAKE2b digest of the text. Near: MinHash over byte shingles plus LSH banding.

Near-duplicate details (all numpy, deterministic for a given seed):

* whitespace runs are collapsed to one space, so re-indented or re-wrapped copies still match;
* shingles are the overlapping ``shingle_bytes``-byte windows (16 bytes ~ 3-4 tokens of code),
  hashed with a polynomial hash mod 2**64 computed for all windows at once;
* ``num_perm`` (128) hash functions ``(a*x + b) mod 2**64`` (odd ``a``, top 32 bits kept) give the
  signature; two documents' estimated Jaccard similarity is the share of equal signature entries;
* LSH: the signature is cut into ``bands`` (16) bands of 8 rows; documents sharing any band are
  candidates, which catches pairs with Jaccard >= 0.8 with probability ~95% (1 - (1 - 0.8**8)**16);
* a candidate counts as a duplicate only when the estimated Jaccard is >= ``threshold`` (0.8).
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

_WHITESPACE = re.compile(r"\s+")
_SHINGLE_BASE = np.uint64(1099511628211)  # FNV-64 prime: odd, so the polynomial hash mixes all bits
_CHUNK = 4096  # shingles hashed per step, bounding the [num_perm, chunk] temporary to 4 MiB


def text_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class ExactDeduper:
    def __init__(self) -> None:
        self._seen: set[bytes] = set()

    def is_new(self, digest: bytes) -> bool:
        """True the first time a digest is seen."""
        if digest in self._seen:
            return False
        self._seen.add(digest)
        return True


class NearDeduper:
    """Streaming MinHash-LSH index of the documents kept so far."""

    def __init__(self, num_perm: int = 128, bands: int = 16, threshold: float = 0.8,
                 shingle_bytes: int = 16, seed: int = 1337):
        if num_perm % bands:
            raise ValueError(f"num_perm={num_perm} must be a multiple of bands={bands}")
        rng = np.random.default_rng(seed)
        self._a = (rng.integers(0, 2**63, num_perm, dtype=np.uint64) << np.uint64(1)) | np.uint64(1)
        self._b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self._rows = num_perm // bands
        self._bands = bands
        self._threshold = threshold
        self._k = shingle_bytes
        self._powers = _SHINGLE_BASE ** np.arange(shingle_bytes - 1, -1, -1, dtype=np.uint64)
        self._buckets: list[dict[bytes, list[int]]] = [defaultdict(list) for _ in range(bands)]
        self._signatures: list[np.ndarray] = []

    def _shingles(self, text: str) -> np.ndarray:
        data = np.frombuffer(_WHITESPACE.sub(" ", text).encode("utf-8"), dtype=np.uint8).astype(np.uint64)
        if len(data) < self._k:  # shorter than one shingle: the whole text is the only shingle
            data = np.pad(data, (0, self._k - len(data)))
        n = len(data) - self._k + 1
        hashes = np.zeros(n, dtype=np.uint64)
        for j in range(self._k):  # k vector passes over all windows; uint64 arithmetic wraps mod 2**64
            hashes += data[j:j + n] * self._powers[j]
        return np.unique(hashes)

    def signature(self, text: str) -> np.ndarray:
        """MinHash signature (uint32[num_perm]) of the text's shingle set."""
        shingles = self._shingles(text)
        sig = np.full(len(self._a), np.iinfo(np.uint64).max, dtype=np.uint64)
        buffer = np.empty((len(self._a), min(_CHUNK, len(shingles))), dtype=np.uint64)
        for start in range(0, len(shingles), _CHUNK):
            x = shingles[start:start + _CHUNK]
            hashed = buffer[:, :len(x)]
            np.multiply(self._a[:, None], x[None, :], out=hashed)
            hashed += self._b[:, None]
            np.minimum(sig, hashed.min(axis=1), out=sig)
        # Keeping the top 32 bits after the min is the same as before it (the shift is monotonic).
        return (sig >> np.uint64(32)).astype(np.uint32)

    def _lookup(self, sig: np.ndarray) -> tuple[bool, list[bytes]]:
        """Whether an indexed document is a near duplicate of the signature ``sig``, and its band keys."""
        keys = [sig[i * self._rows:(i + 1) * self._rows].tobytes() for i in range(self._bands)]
        candidates = {c for band, key in enumerate(keys) for c in self._buckets[band].get(key, ())}
        if candidates:
            others = np.stack([self._signatures[c] for c in sorted(candidates)])
            if (others == sig).mean(axis=1).max() >= self._threshold:
                return True, keys
        return False, keys

    def is_near(self, text: str) -> bool:
        """Whether an indexed document is a near duplicate of ``text``, which is not indexed (a validation
        document checked against the training ones)."""
        return self._lookup(self.signature(text))[0]

    def is_new(self, text: str) -> bool:
        """False when an earlier kept document is a near duplicate; otherwise index this one."""
        sig = self.signature(text)
        near, keys = self._lookup(sig)
        if near:
            return False
        doc_id = len(self._signatures)
        self._signatures.append(sig)
        for band, key in enumerate(keys):
            self._buckets[band][key].append(doc_id)
        return True


def keep_mask(texts: Iterable[str], near: bool = False, **near_options) -> np.ndarray:
    """Boolean mask of the documents to keep: exact (and, if ``near``, near) duplicates dropped."""
    exact = ExactDeduper()
    nearest = NearDeduper(**near_options) if near else None
    keep = [exact.is_new(text_digest(t)) and (nearest is None or nearest.is_new(t)) for t in texts]
    return np.array(keep, dtype=bool)

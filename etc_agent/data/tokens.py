"""A memory-mapped token dataset: one flat token file, document offsets, fixed-length sequences.

A dataset directory holds:

- ``tokens.bin``: every document's tokens end to end, little-endian ``uint16`` or ``uint32``;
- ``offsets.bin``: ``uint64`` start of each document in ``tokens.bin`` (for auditing and
  document-aware use; sequences below run across document ends, as GPT-style training does);
- ``meta.json``: ``{"format": "etc-tokens", "version": 1, "dtype", "num_tokens", "num_documents",
  "seq_len", "vocab_size", "tokenizer", "corpus"}``;
- ``tokenizer.json``: the tokenizer that made the tokens (``scripts/prepare_data.py``).

Sample ``i`` is ``seq_len + 1`` tokens from ``i * seq_len`` (inputs and shifted targets). Every
check runs when the dataset is opened, before any state is touched: a missing, truncated or
mismatched file is one :class:`DataError` line naming the file and what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

FORMAT = "etc-tokens"
VERSION = 1
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class DataError(ValueError):
    """A dataset that cannot be read as it says it is (one line: the file and what is wrong)."""


class TokenDataset(torch.utils.data.Dataset):
    """Map-style: ``dataset[i]`` is sample ``i`` as an int64 tensor of ``seq_len + 1`` tokens."""

    def __init__(self, path: str | Path, seq_len: int | None = None):
        """``seq_len``: sequences of this length instead of the one ``meta.json`` names."""
        self.path = Path(path)
        meta = _read_meta(self.path)
        self.dtype_name = meta["dtype"]
        self.num_tokens = int(meta["num_tokens"])
        self.seq_len = int(seq_len or meta["seq_len"])
        self.vocab_size = int(meta["vocab_size"])
        self.meta = meta
        tokens = self.path / "tokens.bin"
        width = DTYPES[self.dtype_name].itemsize
        size = tokens.stat().st_size if tokens.is_file() else None
        if size is None:
            raise DataError(f"dataset {self.path}: tokens.bin is missing")
        if size != self.num_tokens * width:
            raise DataError(
                f"dataset {self.path}: tokens.bin holds {size} bytes, meta.json says {self.num_tokens} tokens of "
                f"{self.dtype_name} ({self.num_tokens * width} bytes): the file is truncated or of another token width"
            )
        if self.seq_len < 1 or self.seq_len + 1 > self.num_tokens:
            raise DataError(
                f"dataset {self.path}: a sequence of {self.seq_len} tokens (+1 target) is longer than its "
                f"{self.num_tokens} tokens"
            )
        self._tokens: np.memmap | None = None
        self.num_samples = (self.num_tokens - 1) // self.seq_len
        probe = self._array()[: min(self.num_tokens, 1 << 16)]
        if probe.size and int(probe.max()) >= self.vocab_size:
            raise DataError(
                f"dataset {self.path}: token id {int(probe.max())} >= vocab_size {self.vocab_size}: tokens.bin is "
                f"not of the width or tokenizer meta.json names"
            )

    def _array(self) -> np.memmap:
        if self._tokens is None:  # opened lazily: each loader worker process maps the file itself
            self._tokens = np.memmap(self.path / "tokens.bin", dtype=DTYPES[self.dtype_name], mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        start = index * self.seq_len
        window = self._array()[start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokens"] = None  # a worker process maps the file anew
        return state


def _read_meta(path: Path) -> dict:
    meta_file = path / "meta.json"
    if not path.is_dir():
        raise DataError(
            f"dataset {path}: no such directory (make one with `python scripts/prepare_data.py --out {path}`)"
        )
    if not meta_file.is_file():
        raise DataError(f"dataset {path}: meta.json is missing")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as err:
        raise DataError(f"dataset {path}: meta.json does not parse ({err})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"dataset {path}: meta.json is not {FORMAT} version {VERSION}")
    if meta.get("dtype") not in DTYPES:
        raise DataError(f"dataset {path}: token dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    for key in ("num_tokens", "seq_len", "vocab_size"):
        if not isinstance(meta.get(key), int) or meta[key] < 1:
            raise DataError(f"dataset {path}: meta.json's {key} is {meta.get(key)!r}, not a positive integer")
    return meta


def write_dataset(
    path: str | Path, documents: list[list[int]], seq_len: int, vocab_size: int, tokenizer: str, corpus: str
) -> dict:
    """Write token documents as a dataset directory (``tokenizer``: the tokenizer file's name there)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    flat = np.fromiter((t for doc in documents for t in doc), dtype=DTYPES[dtype])
    offsets = np.cumsum([0] + [len(doc) for doc in documents[:-1]], dtype="<u8")
    flat.tofile(out / "tokens.bin")
    offsets.tofile(out / "offsets.bin")
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "num_tokens": int(flat.size),
        "num_documents": len(documents),
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "corpus": corpus,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


__all__ = ["DataError", "TokenDataset", "write_dataset"]

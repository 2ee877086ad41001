"""The default token dataset, built offline from a real public corpus that every CPython ships.

The corpus is the Python documentation in ``pydoc_data.topics`` (the reference manual's topics, the
text ``help()`` shows; about 460 thousand characters, one document per topic). The tokenizer is a
byte-level BPE trained on that corpus with ``tokenizers`` (nothing is downloaded); it is saved
beside the tokens as ``tokenizer.json``. ``scripts/prepare_data.py`` is the command line;
:func:`default_dataset` is what the examples train on when ``--data`` names no dataset of its own:
built once per machine (about 3 s), under a lock, so the workers of a node that all start at once
build it once and the others wait for it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any

from etc_agent.data.tokens import TokenDataset, write_dataset

__all__ = ["CORPUS", "build_dataset", "default_data_dir", "default_dataset"]

CORPUS = "pydoc_data.topics (the Python reference documentation's topics, shipped with CPython)"
DEFAULT_NAME = "pydoc-bpe4096"
"""The default dataset's directory name: its corpus and vocabulary (a change of either is a new name)."""


def corpus_documents() -> list[str]:
    import pydoc_data.topics as topics

    return [topics.topics[name].strip() for name in sorted(topics.topics) if topics.topics[name].strip()]


def train_tokenizer(documents: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def build_dataset(out: Path, vocab_size: int = 4096, seq_len: int = 64) -> dict[str, Any]:
    """Tokenize the corpus into ``out`` (``tokens.bin``, ``meta.json``, ``tokenizer.json``); every
    document ends with ``<|endoftext|>``. Returns what was written (one JSON-able summary)."""
    if not 256 < vocab_size <= 65536:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs 257 to 65536 tokens")
    started = time.perf_counter()
    documents = corpus_documents()
    tokenizer = train_tokenizer(documents, vocab_size)
    end = tokenizer.token_to_id("<|endoftext|>")
    encoded = [enc.ids + [end] for enc in tokenizer.encode_batch(documents)]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    meta = write_dataset(out, encoded, seq_len, tokenizer.get_vocab_size(), "tokenizer.json", CORPUS)
    dataset = TokenDataset(out)  # every check a reader makes
    return {
        "out": str(out),
        **{k: meta[k] for k in ("num_tokens", "num_documents", "seq_len", "vocab_size", "dtype")},
        "num_samples": len(dataset),
        "seconds": round(time.perf_counter() - started, 2),
    }


def default_data_dir() -> Path:
    """Where the default dataset lives: ``$ETC_DATA_DIR``, else ``$XDG_CACHE_HOME/etc_agent``, else
    ``~/.cache/etc_agent``."""
    if os.environ.get("ETC_DATA_DIR"):
        return Path(os.environ["ETC_DATA_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "etc_agent"


def default_dataset(root: Path | None = None) -> Path:
    """The default dataset's directory under ``root`` (:func:`default_data_dir`), built there first
    if it is not. Concurrent callers (the workers of a node) build it once: the first takes a lock
    file, builds into a directory of its own and renames it into place; the others wait on the lock
    and find it built."""
    root = root or default_data_dir()
    path = root / DEFAULT_NAME
    if (path / "meta.json").exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{DEFAULT_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "meta.json").exists():
            building = root / f".{DEFAULT_NAME}.building-{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            build_dataset(building)
            shutil.rmtree(path, ignore_errors=True)  # a directory a killed build left without meta.json
            building.rename(path)
    return path

"""Build a token dataset (``etc_agent.data.tokens``) from a real public text corpus, offline.

    python scripts/prepare_data.py --out data/pydoc            # the default small dataset
    python scripts/prepare_data.py --out data/pydoc --vocab-size 8192 --seq-len 128

The corpus is the Python documentation that every CPython ships in ``pydoc_data.topics`` (the
reference manual's topics, the text ``help()`` shows; about 460 thousand characters, one document
per topic). The tokenizer is a byte-level BPE trained on that corpus with ``tokenizers`` (nothing
is downloaded); it is saved beside the tokens as ``tokenizer.json``. Prints one JSON line with what
it wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from etc_agent.data.tokens import TokenDataset, write_dataset

CORPUS = "pydoc_data.topics (the Python reference documentation's topics, shipped with CPython)"


def corpus_documents() -> list[str]:
    import pydoc_data.topics as topics

    return [topics.topics[name].strip() for name in sorted(topics.topics) if topics.topics[name].strip()]


def train_tokenizer(documents: list[str], vocab_size: int):
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="The dataset directory to write.")
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (tokens of uint16 up to 65536).")
    ap.add_argument("--seq-len", type=int, default=64, help="Tokens per training sequence (the target adds one).")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    documents = corpus_documents()
    tokenizer = train_tokenizer(documents, args.vocab_size)
    end = tokenizer.token_to_id("<|endoftext|>")
    encoded = [enc.ids + [end] for enc in tokenizer.encode_batch(documents)]
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    meta = write_dataset(args.out, encoded, args.seq_len, tokenizer.get_vocab_size(), "tokenizer.json", CORPUS)
    dataset = TokenDataset(args.out)  # every check a reader makes
    summary = {
        "out": str(args.out),
        **{k: meta[k] for k in ("num_tokens", "num_documents", "seq_len", "vocab_size", "dtype")},
        "num_samples": len(dataset),
        "seconds": round(time.perf_counter() - started, 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

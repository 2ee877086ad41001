"""Build a token dataset (``etc_agent.data.tokens``) from a real public text corpus, offline.

    python scripts/prepare_data.py --out data/pydoc            # the default small dataset
    python scripts/prepare_data.py --out data/pydoc --vocab-size 8192 --seq-len 128

The corpus is the Python documentation that every CPython ships in ``pydoc_data.topics``; the
tokenizer a byte-level BPE trained on it with ``tokenizers`` (:mod:`etc_agent.data.prepare`, which
also builds the dataset the examples train on by default). Prints one JSON line with what it wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from etc_agent.data.prepare import build_dataset


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="The dataset directory to write.")
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (tokens of uint16 up to 65536).")
    ap.add_argument("--seq-len", type=int, default=64, help="Tokens per training sequence (the target adds one).")
    args = ap.parse_args(argv)
    try:
        summary = build_dataset(args.out, args.vocab_size, args.seq_len)
    except ValueError as err:
        ap.error(str(err))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

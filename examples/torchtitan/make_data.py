"""Write the offline dataset of the torchtitan example: ``python -m examples.torchtitan.make_data DIR [--docs N]``.

``DIR/data.json`` gets N (default 2000) JSON lines ``{"text": ...}``, c4_test's format, each a consecutive
1 KiB window of the Shakespeare corpus (examples.data.load_corpus, decoded as Latin-1): the same bytes on every run.
Pass ``--dataloader.dataset-path DIR`` to torchtitan (the ``c4_test`` loader reads a local folder with
``datasets.load_dataset(DIR, split="train")``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.data import load_corpus  # noqa: E402

DOC_BYTES = 1024


def write(directory: str, docs: int = 2000) -> str:
    """Write ``directory/data.json`` (created if missing) with ``docs`` documents; returns its path. Raises
    ValueError when ``docs`` < 1 or the corpus is shorter than that many documents."""
    corpus = load_corpus()
    if docs < 1 or docs * DOC_BYTES > corpus.numel():
        raise ValueError(f"--docs must be between 1 and {corpus.numel() // DOC_BYTES}, not {docs}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "data.json")
    raw = corpus[: docs * DOC_BYTES].numpy().tobytes()
    with open(path + ".tmp", "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": raw[i * DOC_BYTES:(i + 1) * DOC_BYTES].decode("latin-1")}) + "\n")
    os.replace(path + ".tmp", path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="where data.json goes")
    p.add_argument("--docs", type=int, default=2000, help="number of 1 KiB documents")
    args = p.parse_args(argv)
    try:
        print(write(args.directory, args.docs))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()

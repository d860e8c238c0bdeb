"""sluice-prepare-data: writes the training corpus as a token file for sluice-train --data (see
sluice.training.data for the corpus, its sources and its tokenizers).

    sluice-prepare-data --out corpus.npz [--sources all] [--tokenizer bpe --vocab-size 8192]
"""

from __future__ import annotations

import argparse

from ..training.data import DEFAULT_SOURCES, SOURCES, TokenData, prepare_data


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="sluice-prepare-data",
        description="Write the training corpus as a token file for sluice-train --data.",
    )
    p.add_argument("--out", required=True, help="output .npz path")
    p.add_argument("--source", help="a directory of .txt documents instead of --sources")
    p.add_argument(
        "--sources",
        default=",".join(DEFAULT_SOURCES),
        help=f"comma-separated, of {', '.join(SOURCES)} or 'all' (default: %(default)s)",
    )
    p.add_argument(
        "--tokenizer",
        choices=("bytes", "bpe"),
        default="bytes",
        help="bytes (default), or a byte-level BPE learned from the training documents",
    )
    p.add_argument(
        "--vocab-size", type=int, default=8192, help="the BPE's vocabulary (default: %(default)s)"
    )
    a = p.parse_args(argv)
    names = tuple(SOURCES) if a.sources == "all" else tuple(a.sources.split(","))
    out = prepare_data(a.out, a.source, names, a.tokenizer, a.vocab_size)
    data = TokenData.load(out)
    print(
        f"wrote {out}: {len(data.train)} train and {len(data.val)} validation tokens, "
        f"vocabulary {data.vocab_size} ({a.tokenizer})"
    )


if __name__ == "__main__":
    main()

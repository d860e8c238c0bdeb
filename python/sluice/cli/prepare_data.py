"""sluice-prepare-data: writes the training corpus as a token file for sluice-train --data (see
sluice.training.data for the corpus, its sources and its tokenizers).

    sluice-prepare-data --out corpus.npz [--sources all] [--tokenizer bpe --vocab-size 8192]
"""

from __future__ import annotations

import os

from ..training.data import DEFAULT_SOURCES, MAX_VOCAB, SOURCES, TokenData, prepare_data
from .usage import Parser, UsageError, command, int_range


@command("sluice-prepare-data")
def main(argv=None):
    p = Parser(
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
        help="bytes (default), or a byte-level BPE learned from the training documents (needs "
        "sluice's bpe extra: Hugging Face tokenizers)",
    )
    p.add_argument(
        "--vocab-size",
        type=int_range(258, MAX_VOCAB),
        default=8192,
        help="the BPE's vocabulary (default: %(default)s)",
    )
    a = p.parse_args(argv)
    names = tuple(SOURCES) if a.sources == "all" else tuple(a.sources.split(","))
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        p.error(
            f"argument --sources: unknown source {unknown[0]!r}, expected some of "
            f"{', '.join(SOURCES)} or 'all'"
        )
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder):
        p.error(f"argument --out: {folder} is not a directory")
    if os.path.isdir(a.out):
        p.error(f"argument --out: {a.out} is a directory, expected a file name")
    if a.source is not None and not os.path.isdir(a.source):
        p.error(f"argument --source: {a.source} is not a directory")
    try:
        out = prepare_data(a.out, a.source, names, a.tokenizer, a.vocab_size)
    except (FileNotFoundError, ImportError) as e:  # a missing package or documents
        raise UsageError(str(e)) from None
    data = TokenData.load(out)
    print(
        f"wrote {out}: {len(data.train)} train and {len(data.val)} validation tokens, "
        f"vocabulary {data.vocab_size} ({a.tokenizer})"
    )


if __name__ == "__main__":
    main()

"""Real English text for the training run, from Debian packages: nothing is downloaded at run time.

The default corpus is the reStructuredText source of the Python documentation, which Debian ships in
``python3-doc`` (``python3.11-doc`` on Debian 12) under ``/usr/share/doc/python3.X/html/_sources``:
about 500 documents, 11 MB of English prose and code. Tokens are bytes (0-255) plus ``EOS`` between
documents. The split is by document and fixed: a document is in the validation set when the CRC-32
of its path relative to ``_sources`` is 0 mod 20 (about 5% of the text).

``sluice-prepare-data --sources`` adds more text for longer runs (``SOURCES``; ~64 M tokens in all):
the 1913 Webster of ``dict-gcide`` (40 MB, cut into documents of ~64 KB between entries), Perl's
manual (``perl-doc``, 9 MB of POD) and Git's (``git-doc``, 3 MB of AsciiDoc). Their documents are
split the same way, by the CRC-32 of ``<source>/<path>``, and the documents of several sources are
interleaved in a fixed order (by another CRC-32 of their keys), so that every part of the training and
the validation streams mixes them.

Machines without the packages (a GPU machine with no network) read a token file made where they
exist: ``sluice-prepare-data --out corpus.npz`` then ``sluice-train --data corpus.npz``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import zlib
from collections.abc import Iterator

import numpy as np

BOS, EOS, PAD = 256, 257, 258
NUM_TOKENS = 259
VAL_MODULUS = 20
SOURCE_GLOB = "/usr/share/doc/python3.*/html/_sources"
APT_HINT = "apt-get install -y python3-doc  (Debian 12: python3.11-doc)"


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if t < 256).decode("utf-8", errors="replace")


def _missing(what: str, package: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"no training text: {what} is missing. Install it with `apt-get install -y {package}`, "
        "or pass --data with a token file made by sluice-prepare-data on a machine that has it"
    )


def find_source() -> str:
    found = sorted(d for d in glob.glob(SOURCE_GLOB) if os.path.isdir(d))
    if not found:
        raise _missing(SOURCE_GLOB, APT_HINT.removeprefix("apt-get install -y "))
    return found[-1]


def _tree_documents(root: str, pattern: str, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(prefix + path relative to root, text) of every file matching pattern below root."""
    paths = sorted(glob.glob(os.path.join(root, "**", pattern), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no {pattern} documents under {root}")
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield prefix + os.path.relpath(path, root), f.read()


GCIDE_PATH = "/usr/share/dictd/gcide.dict.dz"
GCIDE_DOC_CHARS = 1 << 16
PERL_POD_GLOB = "/usr/share/perl/5.*/pod"
GIT_DOC_DIR = "/usr/share/doc/git-doc"


def _python_docs():
    # keys without a prefix: the default corpus's split is the one every earlier run used
    return _tree_documents(find_source(), "*.txt")


def _gcide():
    """The dictionary (a dictzip file, which gzip reads) cut at the first blank line (between two
    entries) past every GCIDE_DOC_CHARS characters: ~600 documents, so that the validation split
    takes pages from the whole alphabet."""
    if not os.path.exists(GCIDE_PATH):
        raise _missing(GCIDE_PATH, "dict-gcide")
    with gzip.open(GCIDE_PATH, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    start = 0
    while start < len(text):
        cut = text.find("\n\n", start + GCIDE_DOC_CHARS)
        end = len(text) if cut < 0 else cut + 2
        yield f"gcide/{start:09d}", text[start:end]
        start = end


def _perl_pod():
    found = sorted(d for d in glob.glob(PERL_POD_GLOB) if os.path.isdir(d))
    if not found:
        raise _missing(PERL_POD_GLOB, "perl-doc")
    return _tree_documents(found[-1], "*.pod", "perl-pod/")


def _git_doc():
    if not os.path.isdir(GIT_DOC_DIR):
        raise _missing(GIT_DOC_DIR, "git-doc")
    return _tree_documents(GIT_DOC_DIR, "*.txt", "git-doc/")


# name -> documents as (split key, text); the Debian package in each reader's error
SOURCES = {"python-docs": _python_docs, "gcide": _gcide, "perl-pod": _perl_pod, "git-doc": _git_doc}
DEFAULT_SOURCES = ("python-docs",)


def build_corpus(source: str | None = None, sources=DEFAULT_SOURCES) -> dict[str, np.ndarray]:
    """Train/val tokens of every document of `sources` (names in SOURCES), or of every .txt document
    under the directory `source` when it is given."""
    unknown = [n for n in sources if n not in SOURCES]
    if unknown or not sources:
        raise ValueError(f"unknown corpus sources {unknown}: expected some of {sorted(SOURCES)}")
    if source is not None:
        docs = [_tree_documents(source, "*.txt")]
    else:
        docs = [SOURCES[n]() for n in sources]
    docs = [d for it in docs for d in it]
    if len(sources) > 1 and source is None:  # a fixed shuffle: every part of each stream mixes them
        docs.sort(key=lambda d: (zlib.crc32(b"order/" + d[0].encode()), d[0]))
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eos = np.array([EOS], np.uint16)
    for key, text in docs:
        split = "val" if zlib.crc32(key.encode()) % VAL_MODULUS == 0 else "train"
        parts[split] += [encode(text), eos]
    return {k: np.concatenate(v or [np.zeros(0, np.uint16)]) for k, v in parts.items()}


def prepare_data(out: str, source: str | None = None, sources=DEFAULT_SOURCES) -> str:
    corpus = build_corpus(source, sources)
    np.savez_compressed(out, train=corpus["train"], val=corpus["val"])
    return out if out.endswith(".npz") else out + ".npz"


class TokenData:
    """Train and validation token streams with deterministic batches: batch(step) depends only on
    (seed, step), so a resumed run sees the same data as an uninterrupted one."""

    def __init__(self, train: np.ndarray, val: np.ndarray):
        self.train = np.asarray(train, np.int32)
        self.val = np.asarray(val, np.int32)

    @classmethod
    def load(cls, path: str | None = None) -> TokenData:
        if path is None:
            return cls(**build_corpus())
        with np.load(path) as f:
            return cls(f["train"], f["val"])

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0) -> np.ndarray:
        """[batch_size, seq_len + 1] int32 windows at random places of the training stream."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch_size)
        return self.train[starts[:, None] + np.arange(seq_len + 1)[None, :]]

    def val_batches(self, num_batches: int, batch_size: int, seq_len: int) -> list[np.ndarray]:
        """The first num_batches*batch_size disjoint windows of the validation stream (fixed)."""
        n = num_batches * batch_size
        if n * (seq_len + 1) > len(self.val):
            raise ValueError(
                f"validation stream of {len(self.val)} tokens is too short for {n} windows of "
                f"{seq_len + 1}"
            )
        windows = self.val[: n * (seq_len + 1)].reshape(n, seq_len + 1)
        return [windows[i * batch_size : (i + 1) * batch_size] for i in range(num_batches)]


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Write the training corpus as a token file for sluice-train --data."
    )
    p.add_argument("--out", required=True, help="output .npz path")
    p.add_argument("--source", help="a directory of .txt documents instead of --sources")
    p.add_argument(
        "--sources",
        default=",".join(DEFAULT_SOURCES),
        help=f"comma-separated, of {', '.join(SOURCES)} or 'all' (default: %(default)s)",
    )
    a = p.parse_args(argv)
    names = tuple(SOURCES) if a.sources == "all" else tuple(a.sources.split(","))
    out = prepare_data(a.out, a.source, names)
    with np.load(out) as f:
        print(f"wrote {out}: {len(f['train'])} train and {len(f['val'])} validation tokens")


if __name__ == "__main__":
    main()

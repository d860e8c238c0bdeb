"""Real English text for the training run, from a Debian package: nothing is downloaded at run time.

The corpus is the reStructuredText source of the Python documentation, which Debian ships in
``python3-doc`` (``python3.11-doc`` on Debian 12) under ``/usr/share/doc/python3.X/html/_sources``:
about 500 documents, 11 MB of English prose and code. Tokens are bytes (0-255) plus ``EOS`` between
documents. The split is by document and fixed: a document is in the validation set when the CRC-32
of its path relative to ``_sources`` is 0 mod 20 (about 5% of the text).

Machines without the package (a GPU machine with no network) read a token file made where it exists:
``sluice-prepare-data --out corpus.npz`` then ``sluice-train --data corpus.npz``.
"""

from __future__ import annotations

import argparse
import glob
import os
import zlib

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


def find_source() -> str:
    found = sorted(d for d in glob.glob(SOURCE_GLOB) if os.path.isdir(d))
    if not found:
        raise FileNotFoundError(
            f"no training text: {SOURCE_GLOB} is missing. Install it with `{APT_HINT}`, "
            "or pass --data with a token file made by sluice-prepare-data on a machine that has it"
        )
    return found[-1]


def build_corpus(source: str | None = None) -> dict[str, np.ndarray]:
    """Every document under source (default: the installed Python docs) as train/val tokens."""
    source = source or find_source()
    paths = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no .txt documents under {source}; reinstall with `{APT_HINT}`")
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eos = np.array([EOS], np.uint16)
    for path in paths:
        rel = os.path.relpath(path, source)
        with open(path, encoding="utf-8", errors="replace") as f:
            doc = encode(f.read())
        split = "val" if zlib.crc32(rel.encode()) % VAL_MODULUS == 0 else "train"
        parts[split] += [doc, eos]
    return {k: np.concatenate(v) for k, v in parts.items()}


def prepare_data(out: str, source: str | None = None) -> str:
    corpus = build_corpus(source)
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
    p.add_argument("--source", help=f"directory of .txt documents (default: {SOURCE_GLOB})")
    a = p.parse_args(argv)
    out = prepare_data(a.out, a.source)
    with np.load(out) as f:
        print(f"wrote {out}: {len(f['train'])} train and {len(f['val'])} validation tokens")


if __name__ == "__main__":
    main()

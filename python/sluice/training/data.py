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

``--tokenizer bpe --vocab-size N`` writes subword tokens instead of bytes: a byte-level BPE (Hugging
Face ``tokenizers``, the scheme of GPT-2 and Llama 3) learned from the training documents only, stored
in the token file beside the tokens, with ``EOS`` as its token 0. ``sluice-train`` sizes the model's
vocabulary from the file, so the same presets run on either.

Machines without the packages (a GPU machine with no network) read a token file made where they
exist: ``sluice-prepare-data --out corpus.npz`` then ``sluice-train --data corpus.npz``.
"""

from __future__ import annotations

import glob
import gzip
import os
import zipfile
import zlib
from collections.abc import Iterator

import numpy as np

BOS, EOS, PAD = 256, 257, 258
NUM_TOKENS = 259  # the byte tokenizer's vocabulary
BPE_EOS = "<eos>"  # the BPE tokenizer's only special token, id 0
MAX_VOCAB = 1 << 16  # tokens are stored as uint16
VAL_MODULUS = 20
SOURCE_GLOB = "/usr/share/doc/python3.*/html/_sources"
APT_HINT = "apt-get install -y python3-doc  (Debian 12: python3.11-doc)"
BPE_EXTRA = (
    "--tokenizer bpe needs Hugging Face tokenizers, sluice's bpe extra: pip install 'sluice[bpe]' "
    "(or pip install tokenizers)"
)


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
    # keys without a prefix, unlike the other sources': the default corpus's split is fixed
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


def _documents(source: str | None, sources) -> dict[str, list[str]]:
    """Train/val texts of every document of `sources` (names in SOURCES), or of every .txt document
    under the directory `source` when it is given, in their fixed order."""
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
    split: dict[str, list[str]] = {"train": [], "val": []}
    for key, text in docs:
        split["val" if zlib.crc32(key.encode()) % VAL_MODULUS == 0 else "train"].append(text)
    return split


def _stream(encoded: list[np.ndarray], eos: int) -> np.ndarray:
    """The documents' tokens, each followed by eos, as one uint16 stream."""
    sep = np.array([eos], np.uint16)
    parts = [p for e in encoded for p in (np.asarray(e, np.uint16), sep)]
    return np.concatenate(parts or [np.zeros(0, np.uint16)])


def build_corpus(source: str | None = None, sources=DEFAULT_SOURCES) -> dict[str, np.ndarray]:
    """Train/val byte tokens of every document of `sources` (names in SOURCES), or of every .txt
    document under the directory `source` when it is given."""
    return {k: _stream([encode(t) for t in v], EOS) for k, v in _documents(source, sources).items()}


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (a `tokenizers.Tokenizer`) of vocab_size tokens learned from texts:
    the 256 bytes, BPE_EOS (id 0) and the merges."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError(BPE_EXTRA) from None
    if not 258 <= vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"--vocab-size {vocab_size}: expected 258 to {MAX_VOCAB} (the 256 bytes and {BPE_EOS} "
            "at least; tokens are stored as uint16)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id(BPE_EOS) == 0
    return tok


def prepare_data(
    out: str,
    source: str | None = None,
    sources=DEFAULT_SOURCES,
    tokenizer: str = "bytes",
    vocab_size: int = 8192,
) -> str:
    """Writes the corpus's train/val token streams to out (.npz) and returns its path. tokenizer
    "bytes": one token a byte;
    "bpe": a byte-level BPE of vocab_size tokens learned from the training documents, stored in the
    file (`tokenizer`, its JSON) with `vocab_size`."""
    if tokenizer == "bytes":
        arrays = build_corpus(source, sources)
    elif tokenizer == "bpe":
        docs = _documents(source, sources)
        tok = train_bpe(docs["train"], vocab_size)
        arrays = {
            k: _stream([e.ids for e in tok.encode_batch(v)], tok.token_to_id(BPE_EOS))
            for k, v in docs.items()
        }
        arrays["tokenizer"] = np.array(tok.to_str())
        arrays["vocab_size"] = np.array(tok.get_vocab_size(), np.int64)
        # bytes of text a token stands for (a byte-level token's string has a character per byte;
        # an end of document counts as one, as in the byte streams): training reads these, so it
        # needs no tokenizers package
        lengths = [len(tok.id_to_token(i)) for i in range(tok.get_vocab_size())]
        lengths[tok.token_to_id(BPE_EOS)] = 1
        arrays["token_bytes"] = np.array(lengths, np.int32)
    else:
        raise ValueError(f"tokenizer {tokenizer!r}: expected 'bytes' or 'bpe'")
    np.savez_compressed(out, **arrays)
    return out if out.endswith(".npz") else out + ".npz"


class TokenData:
    """Train and validation token streams with deterministic batches: batch(step) depends only on
    (seed, step), so a resumed run sees the same data as an uninterrupted one. vocab_size: the
    tokenizer's (NUM_TOKENS for bytes); tokenizer: the BPE tokenizer's JSON and token_bytes the bytes
    of text each of its tokens stands for, or None for bytes."""

    def __init__(
        self,
        train,
        val,
        vocab_size: int = NUM_TOKENS,
        tokenizer: str | None = None,
        token_bytes=None,
    ):
        self.train = np.asarray(train, np.int32)
        self.val = np.asarray(val, np.int32)
        self.vocab_size = int(vocab_size)
        self.tokenizer = tokenizer
        self.token_bytes = None if token_bytes is None else np.asarray(token_bytes, np.int64)
        if self.token_bytes is not None and self.token_bytes.shape != (self.vocab_size,):
            raise ValueError(f"token file: token_bytes is not [{self.vocab_size}]")
        top = max((int(x.max()) for x in (self.train, self.val) if x.size), default=-1)
        if top >= self.vocab_size:
            raise ValueError(f"token file: token {top} outside its vocabulary of {self.vocab_size}")

    @classmethod
    def load(cls, path: str | None = None) -> TokenData:
        """The token file at `path` (ValueError where it is not one), or the default corpus read
        from its Debian package (FileNotFoundError naming the package where it is missing)."""
        if path is None:
            return cls(**build_corpus())
        if not zipfile.is_zipfile(path):
            raise ValueError(
                f"{path}: not a token file (expected an .npz from sluice-prepare-data)"
            )
        with np.load(path) as f:
            if not {"train", "val"} <= set(f.files):
                raise ValueError(
                    f"{path}: not a token file (an .npz without the train and val arrays of "
                    "sluice-prepare-data's)"
                )
            if "tokenizer" in f:
                return cls(
                    f["train"],
                    f["val"],
                    int(f["vocab_size"]),
                    str(f["tokenizer"]),
                    f["token_bytes"],
                )
            return cls(f["train"], f["val"])

    def fingerprint(self) -> str:
        """The tokens in a few words (their counts, vocabulary and CRC-32): a resumed run checks it
        reads the tokens it started on."""
        crc = zlib.crc32(self.val.tobytes(), zlib.crc32(self.train.tobytes()))
        return f"{len(self.train)}+{len(self.val)} tokens of {self.vocab_size} (crc32 {crc:08x})"

    def decode(self, tokens) -> str:
        if self.tokenizer is None:
            return decode(tokens)
        try:  # only here: training needs no tokenizers package
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(BPE_EXTRA) from None

        return Tokenizer.from_str(self.tokenizer).decode([int(t) for t in tokens])

    def bytes_per_token(self, tokens) -> float:
        """UTF-8 bytes of text per token over `tokens` (an end of document counts as one byte, as
        in the byte tokenizer's streams): converts a loss per token into one per byte."""
        if self.token_bytes is None:
            return 1.0
        t = np.asarray(tokens).ravel()
        return float(self.token_bytes[t].sum() / max(t.size, 1))

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

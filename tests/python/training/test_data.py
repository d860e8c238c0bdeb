"""The training corpus and token files: sources read from their Debian packages' layouts, a fixed
split and fixed batches, a BPE token file that sizes the model, and clear errors for what is
missing."""

import glob
import gzip
import json
import os

import numpy as np
import pytest
from helpers import records
from sluice.training import data

HAVE_DOCS = bool(glob.glob(data.SOURCE_GLOB))


def test_missing_corpus_names_the_package(monkeypatch):
    monkeypatch.setattr(data, "SOURCE_GLOB", "/nonexistent/python3.*/html/_sources")
    with pytest.raises(FileNotFoundError, match="python3-doc"):
        data.build_corpus()


def test_more_corpus_sources_read_their_packages_layouts(tmp_path, monkeypatch):
    """The extra sources of sluice-prepare-data --sources, on small stand-ins for their packages'
    files: every document's text arrives once, between EOS tokens, in train or val by its key."""
    entries = [f"Word{i} \\Word{i}\\, n.\n   Meaning {i}.\n   [1913 Webster]\n" for i in range(400)]
    gcide = tmp_path / "gcide.dict.dz"
    with gzip.open(gcide, "wt", encoding="utf-8") as f:
        f.write("\n".join(entries))
    pod = tmp_path / "perl" / "5.36.0" / "pod"
    git = tmp_path / "git-doc" / "howto"
    pod.mkdir(parents=True)
    git.mkdir(parents=True)
    (pod / "perlintro.pod").write_text("=head1 NAME\n\nperlintro - a brief introduction\n")
    (git / "setup.txt").write_text("Setting up a repository\n=======================\n")
    monkeypatch.setattr(data, "GCIDE_PATH", str(gcide))
    monkeypatch.setattr(data, "GCIDE_DOC_CHARS", 1000)
    monkeypatch.setattr(data, "PERL_POD_GLOB", str(tmp_path / "perl" / "5.*" / "pod"))
    monkeypatch.setattr(data, "GIT_DOC_DIR", str(tmp_path / "git-doc"))
    docs = list(data.SOURCES["gcide"]())
    assert len(docs) > 10 and "".join(t for _, t in docs) == "\n".join(entries)
    assert all(t.startswith("Word") for _, t in docs)  # cut at blank lines, between entries
    corpus = data.build_corpus(sources=("gcide", "perl-pod", "git-doc"))
    text = data.decode(np.concatenate([corpus["train"], corpus["val"]]))
    assert "perlintro - a brief" in text and "Setting up a repository" in text
    assert "Word399" in text and int((corpus["train"] == data.EOS).sum()) > 10
    with pytest.raises(ValueError, match="unknown corpus sources.*gcide"):
        data.build_corpus(sources=("wikipedia",))
    monkeypatch.setattr(data, "GCIDE_PATH", str(tmp_path / "none.dz"))
    with pytest.raises(FileNotFoundError, match="dict-gcide"):
        data.build_corpus(sources=("gcide",))


@pytest.mark.skipif(not HAVE_DOCS, reason=f"corpus not installed: {data.APT_HINT}")
def test_corpus_split_and_batches_are_fixed(tmp_path):
    path = data.prepare_data(str(tmp_path / "corpus.npz"))
    a, b = data.TokenData.load(path), data.TokenData.load()
    np.testing.assert_array_equal(a.val, b.val)
    assert 0.02 < len(a.val) / (len(a.train) + len(a.val)) < 0.10
    np.testing.assert_array_equal(a.batch(7, 4, 32, seed=1), b.batch(7, 4, 32, seed=1))
    assert not np.array_equal(a.batch(7, 4, 32, seed=1), a.batch(8, 4, 32, seed=1))
    assert "the" in data.decode(a.train[:100_000])


def test_bpe_token_file_round_trips_and_sizes_the_model(tmp_path):
    """sluice-prepare-data --tokenizer bpe on a directory of documents: the tokens decode to the
    documents' text, learned from the training documents only, token_bytes counts the text's bytes
    exactly, and sluice-train sizes the model's vocabulary from the file and logs bits per byte."""
    pytest.importorskip("tokenizers")
    from sluice.cli import train

    rng = np.random.default_rng()
    words = ["expert", "token", "router", "capacity", "grouped", "matmul", "gradient", "naïve"]
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = {}
    for i in range(60):
        text = " ".join(rng.choice(words, 400)) + f"\ndocument {i} ends.\n"
        texts[f"d{i:02d}.txt"] = text
        (docs / f"d{i:02d}.txt").write_text(text, encoding="utf-8")
    path = data.prepare_data(str(tmp_path / "bpe.npz"), str(docs), tokenizer="bpe", vocab_size=300)
    d = data.TokenData.load(path)
    assert d.vocab_size == 300 and d.train.max() < 300 and d.tokenizer is not None
    eos = 0
    assert int((d.train == eos).sum() + (d.val == eos).sum()) == len(texts)
    got = [d.decode(doc) for doc in np.split(d.val, np.flatnonzero(d.val == eos) + 1)[:-1]]
    val_names = [n for n in sorted(texts) if data.zlib.crc32(n.encode()) % data.VAL_MODULUS == 0]
    assert got == [texts[n] for n in val_names]
    # bytes of text per token: the UTF-8 bytes of the documents plus one per end of document
    n_bytes = sum(len(texts[n].encode()) + 1 for n in val_names)
    assert d.bytes_per_token(d.val) * len(d.val) == pytest.approx(n_bytes)
    assert len(d.val) < n_bytes / 2  # merges learned: fewer tokens than bytes
    with pytest.raises(ValueError, match="--vocab-size 100: expected 258"):
        data.prepare_data(str(tmp_path / "x.npz"), str(docs), tokenizer="bpe", vocab_size=100)
    with pytest.raises(ValueError, match="token 299 outside its vocabulary of 299"):
        data.TokenData(d.train, d.val, vocab_size=299)

    out = str(tmp_path / "run")
    train.main(
        ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--seq-len", "16"]
        + ["--batch-size", "4", "--n-layers", "2", "--devices", "1", "--data", path]
        + ["--no-progress", "--no-ckpt", "--eval-every", "2", "--eval-batches", "1"]
        + ["--out", out]
    )
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model"]["vocab_size"] == 320  # 300 rounded up to a multiple of 64
    (ev,) = records(out, "eval")
    bpt = d.bytes_per_token(d.val_batches(1, 4, 16)[0][:, 1:])
    assert ev["val_bpb"] == pytest.approx(ev["val_loss"] / np.log(2) / bpt)

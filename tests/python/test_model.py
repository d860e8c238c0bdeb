"""The decoder LM, its data and its training loop: the expert paths agree, a few steps of the tiny
preset lower the loss on real text, and a checkpointed run resumes to the same result."""

import dataclasses
import glob
import gzip
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
from flax import nnx
from sluice import data
from sluice.model import PRESETS, ModelConfig, Transformer
from sluice.moe import MoEConfig

HAVE_DOCS = bool(glob.glob(data.SOURCE_GLOB))

TINY: ModelConfig = dataclasses.replace(
    PRESETS["tiny"]["model"],
    n_layers=3,
    n_dense_layers=1,
    dtype=jnp.float32,
    moe=dataclasses.replace(
        PRESETS["tiny"]["model"].moe, num_experts=8, top_k=2, dtype=jnp.float32
    ),
)


def _forward(cfg, tokens):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    return jax.jit(lambda m, t: m(t))(model, tokens)


def test_expert_paths_give_the_same_model():
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
    ref, ref_aux = _forward(TINY, tokens)
    for moe in (
        dataclasses.replace(TINY.moe, impl="dense", capacity_factor=8.0),
        dataclasses.replace(TINY.moe, impl="sluice"),
    ):
        logits, aux = _forward(dataclasses.replace(TINY, moe=moe), tokens)
        np.testing.assert_allclose(logits, ref, atol=1e-4)
        np.testing.assert_array_equal(aux["load"], ref_aux["load"])
        assert aux["load"].shape == (2, 8) and float(aux["load"].sum()) == 2 * 2 * 32 * 2
        np.testing.assert_array_equal(aux["dropped"], 0.0)


def test_one_hot_embedding_is_the_lookup(monkeypatch):
    """The embedding's gradient as a one-hot GEMM (vocabularies up to ONE_HOT_MAX_VOCAB) is the
    lookup's own (a scatter-add), and the activations are the lookup's bit for bit in bf16."""
    from sluice import model as model_mod

    cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)

    def run():
        m = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def loss(p):
            logits, _ = nnx.merge(graphdef, p, rest)(tokens)
            return jnp.square(logits.astype(jnp.float32)).mean(), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logits, grads["embed"][...]

    logits, g = run()
    monkeypatch.setattr(model_mod, "ONE_HOT_MAX_VOCAB", 0)
    ref_logits, ref_g = run()
    np.testing.assert_array_equal(
        np.asarray(logits, np.float32), np.asarray(ref_logits, np.float32)
    )
    np.testing.assert_allclose(g, ref_g, rtol=2e-2, atol=1e-6)
    assert np.abs(np.asarray(g)).sum() > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_logits_and_its_gradient(dtype):
    """head_logits: f32 logits of x @ w; its backward takes the logits' gradient in x's dtype (f32:
    autodiff's own, to f32 rounding; bf16: within bf16 rounding of the f32 product's gradients)."""
    from sluice.model import head_logits

    kx, kw, kg = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
    x = jax.random.normal(kx, (2, 24, 64), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (64, 320), jnp.float32) / 8).astype(dtype)
    g = jax.random.normal(kg, (2, 24, 320), jnp.float32)

    def ref(x, w):
        return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)

    out, vjp = jax.vjp(head_logits, x, w)
    ref_out, ref_vjp = jax.vjp(ref, x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, ref_out)
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert np.linalg.norm(got - want) < 1e-2 * np.linalg.norm(want)


def test_attention_implementation_choice():
    from sluice.model import attention_impl

    gpu = jax.default_backend() == "gpu"
    assert attention_impl(dataclasses.replace(TINY, dtype=jnp.bfloat16)) == (
        "cudnn" if gpu else None
    )
    assert attention_impl(TINY) is None  # f32: XLA's
    assert attention_impl(dataclasses.replace(TINY, attention="xla")) == "xla"


def test_parameter_counts():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    counted = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert counted == TINY.total_params()
    moe = TINY.moe
    inactive = (
        (TINY.n_layers - TINY.n_dense_layers)
        * (moe.num_experts - moe.top_k)
        * 3
        * TINY.d_model
        * moe.d_ff
    )
    assert TINY.active_params() == counted - TINY.vocab_size * TINY.d_model - inactive


def test_presets_are_consistent():
    for name, p in PRESETS.items():
        cfg = p["model"]
        assert isinstance(cfg.moe, MoEConfig) and cfg.moe.d_model == cfg.d_model, name
        assert cfg.vocab_size >= data.NUM_TOKENS, name
        assert p["batch_size"] % p["ep"] == 0 and cfg.moe.num_experts % p["ep"] == 0, name
    assert PRESETS["dsv3-proxy"]["model"].moe.num_experts == 256


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
    from sluice import train

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
    (ev,) = _records(out, "eval")
    bpt = d.bytes_per_token(d.val_batches(1, 4, 16)[0][:, 1:])
    assert ev["val_bpb"] == pytest.approx(ev["val_loss"] / np.log(2) / bpt)


def _records(out, kind):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.mark.skipif(not HAVE_DOCS, reason=f"corpus not installed: {data.APT_HINT}")
@pytest.mark.parametrize(
    "fsdp,states,accum",
    [(False, "float32", 1), (True, "float32", 1), (False, "bfloat16", 1), (True, "float32", 2)],
    ids=["ep", "ep+fsdp", "ep+bf16-moments", "ep+fsdp+grad-accum+remat"],
)
def test_training_lowers_loss_and_resumes_exactly(tmp_path, fsdp, states, accum):
    """Eight steps of a two-layer tiny model, data- and expert-parallel over four CPU devices with
    the sluice path (with fsdp: expert weights and their optimizer state also split over the data
    axis; bf16-moments: AdamW's moments kept in bfloat16; grad-accum+remat: each step's
    batch in two micro-batches, every block recomputed in the backward pass); then the run is
    resumed from its step-4 checkpoint and must end on the same loss."""
    from sluice import train

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    corpus = data.prepare_data(str(tmp_path / "corpus.npz"))
    out = str(tmp_path / "run")
    argv = [
        "--preset",
        "tiny",
        "--moe-impl",
        "sluice",
        "--steps",
        "8",
        "--warmup",
        "2",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--n-layers",
        "2",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--log-every",
        "1",
        "--devices",
        "4",
        "--ep",
        "2",
        "--data",
        corpus,
        "--out",
        out,
        "--no-progress",
    ]
    if fsdp:
        argv.insert(0, "--fsdp")
    argv[:0] = ["--opt-state-dtype", states, "--grad-accum", str(accum)]
    if accum > 1:
        argv.insert(0, "--remat")
    train.main(argv)
    steps = _records(out, "train")
    assert [r["step"] for r in steps] == list(range(2, 9))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    evals = _records(out, "eval")
    assert [r["step"] for r in evals] == [4, 8] and evals[1]["val_loss"] < evals[0]["val_loss"]
    for r in steps:
        assert r["dropped"] == 0.0 and r["tgs"] > 0 and r["mfu"] == "n/a"
        assert np.asarray(r["load"]).shape == (1, 16) and sum(r["load"][0]) == 8 * 64 * 4

    resumed = str(tmp_path / "resumed")
    shutil.copytree(out, resumed)
    shutil.rmtree(os.path.join(resumed, "ckpt", "8"))
    train.main(argv[:-2] + [resumed, "--no-progress", "--resume"])
    again = _records(resumed, "train")
    assert [r["step"] for r in again] == [
        2,
        3,
        4,
        6,
        7,
        8,
    ]  # step 5, the first after resuming, compiles
    assert again[-1]["loss"] == pytest.approx(steps[-1]["loss"], abs=1e-5)
    assert _records(resumed, "eval")[-1]["val_loss"] == pytest.approx(
        evals[-1]["val_loss"], abs=1e-5
    )

    pytest.importorskip("matplotlib")
    from sluice import plot

    png = str(tmp_path / "loss.png")
    plot.main([out, resumed, "--out", png, "--labels", "straight,resumed"])
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    plain = plot.read_run(resumed)  # bench/results keeps long runs' metrics gzipped
    metrics = os.path.join(resumed, "metrics.jsonl")
    with open(metrics, "rb") as f, gzip.open(metrics + ".gz", "wb") as g:
        g.write(f.read())
    os.remove(metrics)
    assert plot.read_run(resumed) == plain and plain["eval"]


def test_weight_copies_change_nothing():
    """A training step given compute_copies (the bf16 matrices the optimizer's update makes for the
    next step) gives the same bits as one whose forward pass casts the parameters itself: every
    parameter the copies replace is one the model casts where it uses it. The step's own copies
    are those of its updated parameters; the router and the norms have none."""
    from sluice import train

    cfg = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dtype=jnp.bfloat16))
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    opt, _ = train.make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    opt_state = opt.init(params)
    train_step, eval_step = (jax.jit(f) for f in train.make_steps(graphdef, opt, cfg))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 65)), jnp.int32)
    copies = train.compute_copies(params, cfg.dtype)
    plain = train_step(params, rest, opt_state, tokens, None)
    fast = train_step(params, rest, opt_state, tokens, copies)
    for a, b in zip(jax.tree.leaves(plain[:3]), jax.tree.leaves(fast[:3]), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert float(plain[4]["loss"]) == float(fast[4]["loss"])
    for a, b in zip(
        jax.tree.leaves(train.compute_copies(fast[0], cfg.dtype)), jax.tree.leaves(fast[3])
    ):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    named = {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)}
    with_copy = {
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(copies)
    }
    assert all("router" in k or "norm" in k for k in named - with_copy)
    assert any("router" in k for k in named - with_copy)
    assert float(eval_step(params, rest, tokens, None)) == float(
        eval_step(params, rest, tokens, copies)
    )


@pytest.mark.parametrize("impl", ["sluice", "dense"])
def test_grad_accum_is_one_step_on_the_batch(impl):
    """A step over N micro-batches updates as one step on the whole batch: the mean gradient, the
    batch's loss, its summed expert loads, the same validation loss (float sums in another order
    only; no load-balance loss, which each micro-batch computes on its own tokens, and no drops:
    the dense path's capacity is per micro-batch, so it is given room for every copy)."""
    from sluice import train

    moe = dataclasses.replace(TINY.moe, impl=impl, aux_loss_coef=0.0, capacity_factor=8.0)
    cfg = dataclasses.replace(TINY, moe=moe)
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    opt, _ = train.make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    opt_state = opt.init(params)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 33)), jnp.int32)
    outs = {}
    for n in (1, 2, 4):
        step, ev = (jax.jit(f) for f in train.make_steps(graphdef, opt, cfg, grad_accum=n))
        outs[n] = (step(params, rest, opt_state, tokens), ev(params, rest, tokens))
    (p1, r1, _, _, m1), v1 = outs[1]
    assert float(m1["dropped"]) == 0.0
    for n in (2, 4):
        (pn, rn, _, _, mn), vn = outs[n]
        for a, b in zip(jax.tree.leaves((p1, r1)), jax.tree.leaves((pn, rn)), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)
        np.testing.assert_array_equal(np.asarray(mn["load"]), np.asarray(m1["load"]))
        assert float(mn["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
        assert float(mn["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-4)
        assert float(mn["dropped"]) == 0.0
        assert float(vn) == pytest.approx(float(v1), rel=1e-5)


def test_grad_accum_must_divide_each_devices_rows(tmp_path):
    from sluice import train

    argv = ["--preset", "tiny", "--batch-size", "8", "--devices", "4", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="not divisible by the 4 devices times --grad-accum 3"):
        train.main(argv + ["--grad-accum", "3"])
    with pytest.raises(SystemExit, match="--grad-accum 0: expected a positive number"):
        train.main(argv + ["--grad-accum", "0"])


@pytest.mark.parametrize("ep", [1, 2], ids=["local", "ep2-sluice.ep"])
def test_remat_recomputes_and_changes_nothing_else(ep):
    """--remat (jax.checkpoint around every block; over sluice.ep around the attention and the
    experts' local part (fan-out, SwiGLU, fan-in), not the communication): the same step
    (parameters, loss) from a backward pass that recomputes activations. (What it saves is measured
    on a GPU: the CPU compiler's temporary footprint of this tiny model says little, once smaller
    and once larger.)"""
    from sluice import train

    if len(jax.devices()) < 2 * ep:
        pytest.skip(f"needs {2 * ep} devices")
    mesh = train.make_mesh(ep, 2 * ep) if ep > 1 else None
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (8, 129)), jnp.int32)
    outs = []
    for remat in (False, True):
        moe = dataclasses.replace(TINY.moe, impl="sluice")
        cfg = dataclasses.replace(TINY, moe=moe, remat=remat)
        model = Transformer(cfg, rngs=nnx.Rngs(0), mesh=mesh)
        assert [layer.replays() for layer in model.layers][1:] == [ep == 1] * 2
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt, _ = train.make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
        opt_state = opt.init(params)
        step = jax.jit(train.make_steps(graphdef, opt, cfg)[0])
        jaxpr = str(jax.make_jaxpr(step)(params, rest, opt_state, tokens))
        # one region a block; over sluice.ep two in each MoE block (attention, experts). (The
        # differentiated step holds them as jax's remat primitive, "remat2" in jax 0.10.)
        regions = jaxpr.count("remat") + jaxpr.count("checkpoint[")
        assert regions == (0 if not remat else 3 if ep == 1 else 5)
        outs.append(step(params, rest, opt_state, tokens))
    for a, b in zip(jax.tree.leaves(outs[0][:2]), jax.tree.leaves(outs[1][:2]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    assert float(outs[1][4]["loss"]) == pytest.approx(float(outs[0][4]["loss"]), rel=1e-6)


@pytest.mark.parametrize("ep", [1, 2], ids=["local", "ep2-sluice.ep-on-a-stream"])
def test_interleaved_parts_are_the_same_step(ep):
    """ModelConfig.interleave=2 (each device's sequences in two parts through the layers side by
    side; over sluice.ep with its exchange on stream 1): the same step, loss and router load as one
    part, and the parts stay on their devices (no collective added)."""
    from sluice import train

    if len(jax.devices()) < 2 * ep:
        pytest.skip(f"needs {2 * ep} devices")
    mesh = train.make_mesh(ep, 2 * ep) if ep > 1 else None
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (8, 129)), jnp.int32)
    outs, hlo = [], []
    for n in (1, 2):
        moe = dataclasses.replace(TINY.moe, impl="sluice", ep_stream=1 if ep > 1 else None)
        cfg = dataclasses.replace(TINY, moe=moe, interleave=n)
        model = Transformer(cfg, rngs=nnx.Rngs(0), mesh=mesh)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt, _ = train.make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
        opt_state = opt.init(params)
        step = jax.jit(train.make_steps(graphdef, opt, cfg)[0])
        lowered = step.lower(params, rest, opt_state, tokens)
        assert ("_xla_stream_annotation" in lowered.as_text()) == (ep > 1)
        hlo.append(lowered.compile().as_text())
        outs.append(step(params, rest, opt_state, tokens))
    for a, b in zip(jax.tree.leaves(outs[0][:2]), jax.tree.leaves(outs[1][:2]), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=1e-7)
    m1, m2 = outs[0][4], outs[1][4]
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(m2["load"]), np.asarray(m1["load"]))
    for op in ("all-to-all", "collective-permute", "all-gather"):
        assert hlo[1].count(op) == hlo[0].count(op), op
    with pytest.raises(ValueError, match="interleave=3 must be >= 1 and divide"):
        Transformer(dataclasses.replace(TINY, interleave=3), rngs=nnx.Rngs(0))(tokens[:, :-1])


def test_init_state_is_made_in_its_shardings():
    """train.init_state makes the state by one jit straight into its shardings: the routed experts'
    weights and their AdamW moments split over the expert axis, no other array left alive beside
    the state's own, and the same values as on one device (the init does not depend on the mesh)."""
    from sluice import train

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = dataclasses.replace(TINY, moe=dataclasses.replace(TINY.moe, impl="sluice"))
    opt, _ = train.make_optimizer({"warmup": 2, "steps": 10, "lr": 1e-3})
    before = {id(x) for x in jax.live_arrays()}
    _, state, state_sh, _ = train.init_state(cfg, opt, train.make_mesh(2, 4), seed=3)
    leaves = jax.tree.leaves(state)
    assert {id(x) for x in jax.live_arrays()} - before <= {id(x) for x in leaves}
    e = cfg.moe.num_experts
    split = 0
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(state_sh)):
        assert x.sharding.is_equivalent_to(s, x.ndim), jax.tree_util.keystr(path)
        if train._is_expert_weight(path, x):
            assert x.shape[0] == e and {sh.data.shape[0] for sh in x.addressable_shards} == {e // 2}
            split += 1
    assert split == 3 * 2 * (cfg.n_layers - cfg.n_dense_layers)  # wi, wo; param, mu, nu
    _, one, _, _ = train.init_state(cfg, opt, train.make_mesh(1, 1), seed=3)
    for a, b in zip(leaves, jax.tree.leaves(one), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adam_moments_in_bfloat16():
    """scale_by_adam_in: in float32 it is optax.scale_by_adam; in bfloat16 the moments are stored
    rounded and the updates stay within bf16's rounding of optax's."""
    import optax
    from sluice.train import make_optimizer, scale_by_adam_in

    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32), "b": jnp.zeros(8)}
    grads = [
        jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        for _ in range(5)
    ]
    ref, f32, b16 = (
        optax.scale_by_adam(b2=0.95),
        scale_by_adam_in(jnp.float32, b2=0.95),
        (scale_by_adam_in(jnp.bfloat16, b2=0.95)),
    )
    sr, s32, s16 = ref.init(params), f32.init(params), b16.init(params)
    for g in grads:
        ur, sr = ref.update(g, sr)
        u32, s32 = f32.update(g, s32)
        u16, s16 = b16.update(g, s16)
        for a, b in zip(jax.tree.leaves(u32), jax.tree.leaves(ur)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(ur)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=3e-2, atol=3e-2)
    assert {x.dtype for x in jax.tree.leaves((s16.mu, s16.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert jax.tree.leaves(u16)[0].dtype == jnp.float32
    hp = {"warmup": 2, "steps": 10, "lr": 1e-3, "opt_state_dtype": "bfloat16"}
    opt, _ = make_optimizer(hp)
    st = opt.init(params)
    moments = [x for x in jax.tree.leaves(st) if getattr(x, "ndim", 0) >= 1]
    assert moments and all(x.dtype == jnp.bfloat16 for x in moments)


def _random_corpus(path, val_tokens):
    """A token file of random bytes: 20,000 training tokens, val_tokens validation tokens."""
    rng = np.random.default_rng(0)
    np.savez_compressed(
        path,
        train=rng.integers(0, 256, 20_000).astype(np.int32),
        val=rng.integers(0, 256, val_tokens).astype(np.int32),
    )
    return str(path)


def test_training_fits_evaluation_to_the_validation_stream(tmp_path, capsys):
    """A batch too large for the validation stream: with --eval-every 0 no validation windows are
    needed at all; with evaluation on, only as many batches as the stream holds are used."""
    from sluice import train

    corpus = _random_corpus(tmp_path / "small.npz", 1_000)
    common = [
        "--preset",
        "tiny",
        "--moe-impl",
        "sluice",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--seq-len",
        "16",
        "--n-layers",
        "1",
        "--devices",
        "1",
        "--data",
        corpus,
        "--no-progress",
        "--no-ckpt",
        "--log-every",
        "1",
    ]
    # 128 windows of 17 tokens: more than the 1,000 validation tokens
    train.main(common + ["--batch-size", "128", "--eval-every", "0", "--out", str(tmp_path / "a")])
    assert [r["step"] for r in _records(str(tmp_path / "a"), "train")] == [2]
    # 8 windows of 17: 7 batches fit of the 8 asked for
    train.main(
        common
        + [
            "--batch-size",
            "8",
            "--eval-every",
            "2",
            "--eval-batches",
            "8",
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert "evaluating on 7 batches" in capsys.readouterr().err
    assert [r["step"] for r in _records(str(tmp_path / "b"), "eval")] == [2]


def test_training_stops_when_the_ep_rows_bound_drops(tmp_path):
    """sluice path over sluice.ep with a bound below the routing: the run stops with the reason
    instead of training on dropped copies."""
    from sluice import moe, train

    if len(jax.devices()) < 2 or not moe.sluice_ep_available():
        pytest.skip("needs 2 devices and sluice.ep")
    corpus = _random_corpus(tmp_path / "small.npz", 2_000)
    argv = [
        "--preset",
        "tiny",
        "--moe-impl",
        "sluice",
        "--sluice-dispatch",
        "on",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--n-layers",
        "2",
        "--devices",
        "2",
        "--ep",
        "2",
        "--data",
        corpus,
        "--no-progress",
        "--no-ckpt",
        "--eval-every",
        "0",
        "--log-every",
        "1",
    ]
    train.main(argv + ["--ep-rows-factor", "2.0", "--out", str(tmp_path / "fits")])
    with pytest.raises(SystemExit, match="ep-rows-factor"):
        train.main(argv + ["--ep-rows-factor", "0.05", "--out", str(tmp_path / "drops")])


def test_profile_traces_steps_and_leaves_them_out_of_the_log(tmp_path):
    """--profile 2: the two steps after the compiling one are traced, summarised by sluice-profile
    (the CPU runtime's op time, by category and by op), and not logged as training steps."""
    from sluice import profile, train

    corpus = _random_corpus(tmp_path / "small.npz", 1_000)
    out = str(tmp_path / "run")
    flags = (
        "--preset tiny --moe-impl sluice --steps 5 --warmup 1 --batch-size 4 --seq-len 16 "
        "--n-layers 2 --devices 1 --no-progress --no-ckpt --eval-every 0 --log-every 1 --profile 2"
    )
    train.main(flags.split() + ["--data", corpus, "--out", out])
    assert [r["step"] for r in _records(out, "train")] == [4, 5]
    with open(os.path.join(out, "profile", "summary.txt")) as f:
        text = f.read()
    assert "op time:" in text and "(2 steps)" in text
    rows, where = profile.op_events(profile.trace_file(os.path.join(out, "profile")))
    assert where == "host" and len(rows) > 10 and sum(r[1] for r in rows) > 0
    # busy time: the union of each process's op intervals (overlaps counted once)
    assert 0 < profile.busy_us(rows) <= sum(r[1] for r in rows) + 1e-6
    assert profile.busy_us([("a", 4.0, 0, 0.0), ("b", 4.0, 0, 2.0), ("c", 1.0, 1, 0.0)]) == 7.0
    assert "ops overlapping on several streams" in text
    # the same summary from the trace again, its op table the ops that took the most time first
    assert text == profile.summarize(os.path.join(out, "profile"), steps=2)
    table = text.split("op / kernel\n")[1].splitlines()
    times = [float(line.split()[0]) for line in table]
    assert len(times) > 5 and times == sorted(times, reverse=True)
    # ops named after their source through the step's optimised HLO (hlo.txt beside the trace)
    assert os.path.exists(os.path.join(out, "profile", "hlo.txt"))
    assert any(" <- " in line and ".py:" in line for line in table)
    assert profile.category("sluice_cuda::sm90::gmm_kernel<bf16>") == "sluice"
    assert profile.category("nvjet_sm90_tst_192x192") == "gemm"
    assert profile.category("loop_multiply_fusion") == "other fusion"
    # --profile-from 3: steps 3 and 4 traced, the steps before and after logged
    out = str(tmp_path / "later")
    flags = flags.replace("--steps 5", "--steps 6") + " --profile-from 3"
    train.main(flags.split() + ["--data", corpus, "--out", out])
    assert [r["step"] for r in _records(out, "train")] == [2, 3, 6]
    with open(os.path.join(out, "profile", "summary.txt")) as f:
        assert "(2 steps)" in f.read()
    with pytest.raises(SystemExit, match="--profile 2 from step 7: the run ends at step 6"):
        train.main(flags.replace("-from 3", "-from 7").split() + ["--data", corpus, "--out", out])


def test_router_and_shared_expert_flags_override_the_preset():
    from sluice import train
    from sluice.model import BIAS_UPDATE_RATE

    cfg, _ = train.build_config(train.parse_args(["--preset", "dsv3-proxy"]))
    small = PRESETS["small"]["model"].moe
    assert cfg.moe.bias_update_rate == BIAS_UPDATE_RATE == small.bias_update_rate
    assert cfg.moe.aux_loss_coef == PRESETS["dsv3-proxy"]["model"].moe.aux_loss_coef
    argv = ["--preset", "small", "--bias-update-rate", "0", "--aux-loss-coef", "0.003"]
    cfg, _ = train.build_config(train.parse_args(argv + ["--shared-experts", "0"]))
    assert cfg.moe.bias_update_rate == 0.0 and cfg.moe.aux_loss_coef == 0.003
    assert small.num_shared_experts == 1 and cfg.moe.num_shared_experts == 0
    with pytest.raises(ValueError, match="num_shared_experts must be >= 0"):
        train.build_config(train.parse_args(["--preset", "small", "--shared-experts", "-1"]))
    assert cfg.active_params() == PRESETS["small"]["model"].active_params() - 3 * 512 * 256 * 7
    tiny, _ = train.build_config(train.parse_args(["--preset", "tiny"]))
    assert tiny.moe.aux_loss_coef == PRESETS["tiny"]["model"].moe.aux_loss_coef > 0

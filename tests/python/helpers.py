"""What several test files share: a relative error, and the tiny decoder config, stand-in corpus and
metrics reader of the model and training tests."""

import dataclasses
import json
import os

import numpy as np


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "NaN in output"
    den = np.linalg.norm(b)
    return np.linalg.norm(a - b) / (den if den > 0 else 1.0)


def tiny_config():
    """The tiny preset cut to 3 layers and 8 experts (top-2), in float32."""
    import jax.numpy as jnp
    from sluice.nn.model import PRESETS

    tiny = PRESETS["tiny"]["model"]
    return dataclasses.replace(
        tiny,
        n_layers=3,
        n_dense_layers=1,
        dtype=jnp.float32,
        moe=dataclasses.replace(tiny.moe, num_experts=8, top_k=2, dtype=jnp.float32),
    )


def records(out, kind):
    """The metrics.jsonl records of one kind ("train", "eval", "compile") of a run directory."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def random_corpus(path, val_tokens):
    """A token file of random bytes: 20,000 training tokens, val_tokens validation tokens."""
    rng = np.random.default_rng(0)
    np.savez_compressed(
        path,
        train=rng.integers(0, 256, 20_000).astype(np.int32),
        val=rng.integers(0, 256, val_tokens).astype(np.int32),
    )
    return str(path)

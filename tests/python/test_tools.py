"""The repository's measuring tools that run on any machine (bench/)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import jax, jax.numpy as jnp

@jax.jit
def peak_probe(x):  # two [512, 2048] f32 products, both alive at the last one
    a = jnp.tanh(x @ x.T @ x)
    b = jnp.sin(x @ x.T @ x)
    return (a * b).sum() + (a @ b.T).sum()

peak_probe(jnp.ones((512, 2048), jnp.float32)).block_until_ready()
"""


def test_hlo_peak_reads_a_dump_and_names_the_values_at_the_peak(tmp_path):
    dump = tmp_path / "dump"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*peak_probe.*"
    subprocess.run([sys.executable, "-c", PROBE], env=env, check=True, timeout=300)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hlo_peak.py"), str(dump), "--module", "peak_probe"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    head = [line for line in out.splitlines() if "live at once at most" in line]
    assert len(head) == 1, out
    peak_gib = float(head[0].split("live at once at most ")[1].split(" GiB")[0])
    # a and b (4 MiB each) are live together at the last product
    assert peak_gib >= 8 / 1024, out
    peak = out.split("largest values live at the peak")[1]
    assert "jit(peak_probe)/tanh" in peak and "jit(peak_probe)/sin" in peak, out


def test_hlo_peak_says_what_is_missing(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hlo_peak.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode != 0 and "no optimised HLO or buffer assignment" in r.stderr

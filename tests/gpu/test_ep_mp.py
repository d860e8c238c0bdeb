"""sluice.ep across processes on the GPUs of one host: one process per GPU (jax.distributed, each
process seeing every GPU), transports ipc (CUDA IPC, what 'auto' picks on one host) and nccl (forced
between the GPUs of one host). The checks run in tests/gpu/ep_mp_worker.py. Skipped without 2 GPUs
and a CUDA build.

    python3 -m pytest -q tests/gpu/test_ep_mp.py
    python3 tests/gpu/test_ep_mp.py [ipc nccl auto]      # the same, as a script
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _gpus():
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(transport, nprocs=None, timeout=140, seed=None):
    """Starts the workers (one per GPU, or EP_NPROCS); returns (ok, combined output)."""
    nprocs = nprocs or int(os.environ.get("EP_NPROCS", max(_gpus(), 2)))
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    port = _free_port()
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every process sees every GPU
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "ep_mp_worker.py"),
                "--rank",
                str(i),
                "--nprocs",
                str(nprocs),
                "--port",
                str(port),
                "--transport",
                transport,
                "--seed",
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(nprocs)
    ]
    outs, ok = [], True
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += f"\n[launcher] killed after {timeout} s"
            ok = False
        outs.append(out)
        ok = ok and p.returncode == 0
    return ok, f"seed {seed}\n" + "\n".join(outs)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_multi_process(transport):
    ok, out = run(transport)
    print(out)
    assert ok, out[-6000:]


if __name__ == "__main__":
    bad = 0
    for tr in sys.argv[1:] or ["ipc", "nccl"]:
        ok, out = run(tr)
        print(out, flush=True)
        print(f"test_ep_mp {tr}: {'PASS' if ok else 'FAIL'}", flush=True)
        bad += not ok
    sys.exit(1 if bad else 0)

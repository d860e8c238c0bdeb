"""The one list of shapes, shared by the tests (tests/python, tests/gpu) and the benchmarks (bench/,
which put tests/ on their path). Plain Python and numpy: importing it loads neither jax nor sluice.

Grouped GEMM shapes are (name, M rows, G experts, K, N); group sizes come from `group_sizes`:
numpy.random.default_rng(seed).multinomial(M, p) with p uniform ("uniform") or Dirichlet(0.3)
("skewed": some experts near empty, one several times the mean).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Shape(NamedTuple):
    name: str
    m: int
    g: int
    k: int
    n: int


SHAPES: tuple[Shape, ...] = (
    Shape("dsv3-gateup-ep8", 32768, 32, 7168, 4096),
    Shape("dsv3-down-ep8", 32768, 32, 2048, 7168),
    Shape("mixtral-up", 16384, 8, 4096, 14336),
    Shape("qwen3-30b-up", 65536, 128, 2048, 1536),
)

# The expert matmuls of the dsv3-proxy MoE layer (python/sluice/nn/model.py: D 1024,
# expert F 256 with gate and up fused, 256 experts, top-8) at bench_moe's 8 x 2048 tokens, the
# fine-grained shapes a one-GPU model runs (`bench_gmm.py --shapes fine`).
FINE_SHAPES: tuple[Shape, ...] = (
    Shape("dsv3proxy-gateup", 131072, 256, 1024, 512),
    Shape("dsv3proxy-down", 131072, 256, 256, 1024),
)

# Fine-grained experts with few rows each (`bench_gmm.py --shapes small-groups`): the rows per group
# a step gives a local expert (T*k*R/E: 128 for top-8 of 256 at 4096 tokens per GPU, fewer on a
# skewed step) swept from 16 to 1024, over the local expert counts of real models at several
# expert-parallel degrees: DeepSeek-V3 (256 experts: 32 at EP 8, 8 at EP 32), Qwen3-30B-A3B (128:
# all, or 16 at EP 8), DeepSeek-V2-Lite (64: 16 at EP 4) and the dsv3-proxy model (256: all, or 64
# at EP 4). The problems with few groups of few rows are a handful of tiles and tens of
# microseconds: there the fixed costs of a launch and the fill of the GPU decide.
SMALL_GROUP_ROWS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
SMALL_GROUP_MATMULS: tuple[tuple[str, int, int, int], ...] = (  # (name, G, K, N)
    ("dsv3-gateup", 32, 7168, 4096),
    ("dsv3-down", 32, 2048, 7168),
    ("dsv3-gateup", 8, 7168, 4096),
    ("dsv3-down", 8, 2048, 7168),
    ("qwen3-gateup", 128, 2048, 1536),
    ("qwen3-down", 128, 768, 2048),
    ("qwen3-gateup", 16, 2048, 1536),
    ("qwen3-down", 16, 768, 2048),
    ("dsv2lite-gateup", 16, 2048, 2816),
    ("dsv2lite-down", 16, 1408, 2048),
    ("dsv3proxy-gateup", 256, 1024, 512),
    ("dsv3proxy-down", 256, 256, 1024),
    ("dsv3proxy-gateup", 64, 1024, 512),
    ("dsv3proxy-down", 64, 256, 1024),
)
SMALL_GROUP_SHAPES: tuple[Shape, ...] = tuple(
    Shape(f"{name}-g{g}-r{rows}", rows * g, g, k, n)
    for name, g, k, n in SMALL_GROUP_MATMULS
    for rows in SMALL_GROUP_ROWS
)

# DeepGEMM's published grouped (contiguous layout) shapes: 4 or 8 groups of 8192 or 4096 rows, (N, K)
# (4096, 7168) and (7168, 2048), 1214-1346 TFLOP/s on H800 (bench/bench_fp8.py, `--shapes deepgemm`).
DEEPGEMM_SHAPES: tuple[Shape, ...] = (
    Shape("deepgemm-4x8192-n4096-k7168", 32768, 4, 7168, 4096),
    Shape("deepgemm-4x8192-n7168-k2048", 32768, 4, 2048, 7168),
    Shape("deepgemm-8x4096-n4096-k7168", 32768, 8, 7168, 4096),
    Shape("deepgemm-8x4096-n7168-k2048", 32768, 8, 2048, 7168),
)

DISTRIBUTIONS: tuple[str, ...] = ("uniform", "skewed")

# The CPU tests' grouped GEMM cases: (M, K, N, G, rows routed), small enough for the CPU kernels and
# each with an edge: K and N multiples of nothing, rows past the groups, empty groups, one group, no
# rows routed at all.
TEST_CASES: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 32, 48, 4, 64),
    (77, 19, 131, 5, 60),
    (200, 300, 70, 16, 200),
    (13, 8, 9, 1, 13),
    (40, 17, 23, 8, 0),
)

# bench/bench_cpu_gmm.py's (M, K, N, G) on the CPU kernels: the tiny preset's gate/up, a narrower K,
# and a few large groups.
CPU_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (8192, 128, 128, 16),
    (8192, 64, 128, 16),
    (4096, 512, 256, 8),
)

# SwiGLU expert blocks of bench/bench_swiglu.py: name -> (M rows, G experts, H hidden, F expert
# ffn), gate and up projections of [G, H, F] each and the down projection [G, F, H].
SWIGLU_BLOCKS: dict[str, tuple[int, int, int, int]] = {
    "dsv3-ep8": (32768, 32, 7168, 2048),
    "mixtral": (16384, 8, 4096, 14336),
    "qwen3-30b": (65536, 128, 2048, 768),
}


# Expert-parallel exchange workloads per rank: T tokens of hidden H, top-k of E experts (bench_ep.py).
# "deepep" is DeepEP's published workload; "small" a smoke test that also runs on CPU devices.
EP_WORKLOADS: dict[str, dict[str, int]] = {
    "deepep": {"t": 4096, "h": 7168, "k": 8, "e": 256},
    "small": {"t": 256, "h": 512, "k": 8, "e": 32},
}

# The local fan-out / fan-in on one rank: (N received rows, k slots, L local experts, H hidden)
# (bench_fan.py).
FAN_WORKLOADS: dict[str, tuple[int, int, int, int]] = {
    "dsv3-proxy (1 GPU)": (32768, 8, 256, 1024),
    "dsv3-proxy-ep4 rank (worst-case N = 4T)": (131072, 8, 64, 1024),
    "dsv3 rank of EP8": (16384, 8, 32, 7168),
    "mixtral": (16384, 2, 8, 4096),
}


def select_shapes(spec: str | None) -> tuple[Shape, ...]:
    """Shapes by a comma-separated list of names, "bench" (SHAPES, the default), "fine",
    "small-groups" or "deepgemm"."""
    if not spec or spec == "bench":
        return SHAPES
    if spec == "fine":
        return FINE_SHAPES
    if spec == "small-groups":
        return SMALL_GROUP_SHAPES
    if spec == "deepgemm":
        return DEEPGEMM_SHAPES
    by_name = {s.name: s for s in SHAPES + FINE_SHAPES + SMALL_GROUP_SHAPES + DEEPGEMM_SHAPES}
    unknown = [n for n in spec.split(",") if n not in by_name]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; known: {sorted(by_name)}")
    return tuple(by_name[n] for n in spec.split(","))


def group_sizes(shape: Shape, distribution: str, seed: int = 0) -> np.ndarray:
    """int32 [G] group sizes summing to shape.m."""
    rng = np.random.default_rng(seed)
    if distribution == "exact":  # every group M/G rows (the first M % G one more): no ragged edge
        return (shape.m // shape.g + (np.arange(shape.g) < shape.m % shape.g)).astype(np.int32)
    if distribution == "uniform":
        p = np.full(shape.g, 1.0 / shape.g)
    elif distribution == "skewed":
        p = rng.dirichlet(np.full(shape.g, 0.3))
    else:
        raise ValueError(f"unknown distribution {distribution!r}")
    return rng.multinomial(shape.m, p).astype(np.int32)

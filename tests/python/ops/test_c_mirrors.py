"""The ctypes mirrors of include/sluice.h's descriptor structs (sluice.ops.c_structs, which
sluice.ops.capi and the harnesses in bench/ and tests/gpu/ use) against the header: the same fields in the same order, at the offsets and sizes the C
compiler gives them, and the enum values they copy. A field added to the header and not to a mirror,
or one whose type changed, fails here instead of reaching a C entry point as a wrong value."""

import ctypes
import importlib.util
import pathlib
import re
import shutil
import subprocess

import pytest
from sluice.ops import c_structs, capi

ROOT = pathlib.Path(__file__).resolve().parents[3]
HEADER = ROOT / "include" / "sluice.h"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _bench_gmm():
    spec = importlib.util.spec_from_file_location("bench_gmm", ROOT / "bench" / "bench_gmm.py")
    mod = importlib.util.module_from_spec(spec)
    # its imports are the stdlib and tests/shapes.py; torch comes only inside its functions
    spec.loader.exec_module(mod)
    return mod


BENCH_GMM = _bench_gmm()
MIRRORS = [
    ("sl_gmm_desc", c_structs.GmmDesc),
    ("sl_quantize_fp8_desc", c_structs.QuantDesc),
    ("sl_swiglu_desc", c_structs.SwigluDesc),
    ("sl_ep_comm_desc", c_structs.EpCommDesc),
    ("sl_ep_desc", c_structs.EpDesc),
    ("sl_ep_fan_desc", c_structs.EpFanDesc),
]
DTYPE_NAMES = {  # sl_dtype's C names, by the names DTYPE_CODES uses
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "int32": "I32",
    "float8_e4m3fn": "F8E4M3",
}
CONSTANTS = {  # the C name -> the value a mirror uses
    **{f"SL_DTYPE_{DTYPE_NAMES[k]}": v for k, v in c_structs.DTYPE_CODES.items()},
    **{
        f"SL_EP_TRANSPORT_{'PEER' if k == 'nvlink' else k.upper()}": v
        for k, v in c_structs.EP_TRANSPORTS.items()
    },
}


def header_fields(struct):
    """The member names of `typedef struct <struct> {...} <struct>;` in the header, in order."""
    m = re.search(rf"typedef struct {struct} \{{(.*?)\}} {struct};", HEADER.read_text(), re.DOTALL)
    assert m, f"{struct} not found in {HEADER}"
    body = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.DOTALL))
    # a declaration may name several members ("int64_t batch, rows;")
    decls = [d.strip() for d in body.split(";") if d.strip()]
    return [re.search(r"(\w+)$", part.strip()).group(1) for d in decls for part in d.split(",")]


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    """{struct: size, "struct.field": (offset, size), constant: value} as the C compiler lays them out."""
    if CC is None:
        pytest.skip("no C compiler on PATH")
    lines = []
    for struct in sorted({s for s, _ in MIRRORS}):
        lines.append(f'printf("{struct} %zu\\n", sizeof({struct}));')
        for f in header_fields(struct):
            lines.append(
                f'printf("{struct}.{f} %zu %zu\\n", offsetof({struct}, {f}),'
                f" sizeof((({struct} *)0)->{f}));"
            )
    lines += [f'printf("{c} %d\\n", (int){c});' for c in CONSTANTS]
    src = '#include <stddef.h>\n#include <stdio.h>\n#include "sluice.h"\nint main(void) {\n'
    src += "\n".join(lines) + "\nreturn 0;\n}\n"
    d = tmp_path_factory.mktemp("mirrors")
    (d / "layout.c").write_text(src)
    cmd = [CC, "-std=c11", "-I", str(HEADER.parent), str(d / "layout.c"), "-o", str(d / "layout")]
    subprocess.run(cmd, check=True, timeout=60)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    layout = {}
    for line in out.splitlines():
        name, *vals = line.split()
        layout[name] = tuple(int(v) for v in vals) if len(vals) > 1 else int(vals[0])
    return layout


@pytest.mark.parametrize(
    "struct,mirror", MIRRORS, ids=[f"{m.__module__}.{m.__name__}" for _, m in MIRRORS]
)
def test_mirror_matches_header(struct, mirror, c_layout):
    names = [f for f, _ in mirror._fields_]
    assert names == header_fields(struct), f"{mirror.__module__}.{mirror.__name__} vs {struct}"
    for f in names:
        got = (getattr(mirror, f).offset, getattr(mirror, f).size)
        assert got == c_layout[f"{struct}.{f}"], f"{struct}.{f}: ctypes (offset, size) {got}"
    assert ctypes.sizeof(mirror) == c_layout[struct], struct


def test_copied_constants_match_header(c_layout):
    for name, value in CONSTANTS.items():
        assert value == c_layout[name], name


def test_header_parser_sees_every_member():
    # the parser itself: a pointer member, and members followed by multi-line comments
    assert header_fields("sl_ep_comm_desc")[5] == "device_ordinals"
    assert header_fields("sl_gmm_desc")[-1] == "skip_unused_rows"
    assert header_fields("sl_ep_fan_desc")[-2:] == ["max_rows", "skip_unused_rows"]


def test_capi_and_harnesses_use_these_mirrors():
    # capi re-exports the module's classes; bench_gmm.py loads the same file by its path
    for name in ("GmmDesc", "QuantDesc", "SwigluDesc", "EpCommDesc", "EpDesc", "EpFanDesc"):
        assert getattr(capi, name) is getattr(c_structs, name)
    for name in ("GmmDesc", "QuantDesc", "SwigluDesc"):
        assert getattr(BENCH_GMM, name)._fields_ == getattr(c_structs, name)._fields_
    assert BENCH_GMM.SL_DTYPE_BF16 == c_structs.DTYPE_CODES["bfloat16"]

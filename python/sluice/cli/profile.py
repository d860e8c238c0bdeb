"""Where a traced run's device time goes.

Reads the trace that ``jax.profiler`` writes (``sluice-train --profile N`` makes one of N training
steps) and sums the time of every XLA op's work: on a GPU the kernels of the device's streams, on
the CPU the thunks the XLA CPU runtime ran. Prints the totals by category (sluice's kernels, GEMMs,
attention, collectives, copies, the rest of XLA's fusions) and the ops that took the most time.

    sluice-profile RUN_DIR/profile [--steps N] [--top K]
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys

from .usage import Parser, UsageError, command, positive_int

# first match wins; matched against the kernel (GPU) or op (CPU) name, lower case
CATEGORIES = (
    ("sluice", r"sluice"),
    ("ffi call", r"ffi_call|custom.?call"),  # (on the CPU: sluice's ops, by their HLO name)
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|ynn_dot|(^|_)dot"),
    ("collective", r"nccl|all.?reduce|all.?gather|all.?to.?all|reduce.?scatter|collective"),
    ("copy/memset", r"memcpy|memset|^copy|_copy|transpose"),
    ("reduction", r"reduce|scan|sort|top.?k"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other fusion"


def trace_file(trace_dir: str) -> str:
    """The newest ``*.trace.json.gz`` under trace_dir (jax.profiler's plugins/profile/<run>/)."""
    found = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"{trace_dir}: no *.trace.json.gz under it (expected the profile directory of "
            "sluice-train --profile N, RUN_DIR/profile)"
        )
    return max(found, key=os.path.getmtime)


def op_events(path: str) -> tuple[list[tuple[str, float, int, float]], str]:
    """(kernel or op name, microseconds, process id, start in microseconds) of every event with an
    ``hlo_op``, from the GPU processes when the trace has any (every GPU's, summed: "2 GPUs'"),
    else from the host's; and which it was."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    pname = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    gpu = [e for e in ops if "GPU" in pname.get(e["pid"], "")]
    ngpu = len({e["pid"] for e in gpu})
    chosen, where = (gpu, "GPU" if ngpu == 1 else f"{ngpu} GPUs'") if gpu else (ops, "host")
    rows = [
        (e["name"], float(e.get("dur", 0.0)), e["pid"], float(e.get("ts", 0.0))) for e in chosen
    ]
    return rows, where


def busy_us(rows) -> float:
    """Time at least one op ran, summed over the processes (GPUs): the union of each one's op
    intervals. Below the summed op time by what ran at once on several streams."""
    total = 0.0
    by_pid = collections.defaultdict(list)
    for _, dur, pid, ts in rows:
        by_pid[pid].append((ts, ts + dur))
    for spans in by_pid.values():
        spans.sort()
        end = -float("inf")
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
    return total


def _table(text: str, section: str) -> dict[int, str]:
    """id -> the rest of the line, of one of the HLO text's numbered tables (FileNames, ...)."""
    m = re.search(rf"^{section}\n((?:\d+ .*\n)*)", text, re.MULTILINE)
    rows = (line.split(" ", 1) for line in (m.group(1).splitlines() if m else []))
    return {int(i): rest for i, rest in rows}


def hlo_sources(hlo_text: str) -> dict[str, str]:
    """Kernel or op name (normalised by _norm) -> where the HLO instruction it runs comes from: the
    last part of its op_name ("bwd " when under a transpose, i.e. the backward) and file:line of
    the innermost Python frame, read from the optimised HLO (``jax.jit(f).lower(...).compile()
    .as_text()``). XLA names a fusion's GPU kernel after the fusion, '.' and '-' as '_'."""
    files = {i: v.strip('"') for i, v in _table(hlo_text, "FileNames").items()}
    locs = _table(hlo_text, "FileLocations")
    frames = _table(hlo_text, "StackFrames")

    def where(frame_id: int) -> str:
        fr = re.search(r"file_location_id=(\d+)", frames.get(frame_id, ""))
        loc = locs.get(int(fr.group(1)), "") if fr else ""
        fm, lm = re.search(r"file_name_id=(\d+)", loc), re.search(r"\bline=(\d+)", loc)
        if not (fm and lm):
            return ""
        return f"{os.path.basename(files.get(int(fm.group(1)), '?'))}:{lm.group(1)}"

    out = {}
    pattern = r"^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]*)\"(.*?)\}"
    for m in re.finditer(pattern, hlo_text, re.MULTILINE):
        name, op_name, rest = m.groups()
        op = ("bwd " if "transpose(" in op_name else "") + op_name.split("/")[-1].split(";")[0]
        fid = re.search(r"stack_frame_id=(\d+)", rest)
        src = where(int(fid.group(1))) if fid else ""
        out[_norm(name)] = f"{op} @ {src}" if src else op
    return out


def _norm(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


def summarize(trace_dir: str, steps: int | None = None, top: int = 40) -> str:
    """The summary table as text: per category and per op, total ms, per step when steps is
    given, and share of the traced op time."""
    path = trace_file(trace_dir)
    rows, where = op_events(path)
    hlo_path = os.path.join(trace_dir, "hlo.txt")  # (sluice-train --profile writes it)
    sources = {}
    if os.path.exists(hlo_path):
        with open(hlo_path) as f:
            sources = hlo_sources(f.read())
    total = sum(r[1] for r in rows)
    busy = busy_us(rows)
    per = steps or 1
    by_cat: dict[str, float] = collections.Counter()
    # by kernel (GPU: the same kernel runs under several HLO ops, e.g. each CUDA graph's
    # command_buffer) or by op (host: the op's name is all there is)
    by_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, dur, _, _ in rows:
        by_cat[category(name)] += dur
        acc = by_op[name]
        acc[0] += dur
        acc[1] += 1
    unit = "ms/step" if steps else "ms"
    lines = [
        f"# {path}",
        f"# {where} op time: {total / 1e3 / per:.2f} {unit} over {len(rows)} op executions"
        + (f" ({steps} steps)" if steps else ""),
        (
            f"# busy (some op running): {busy / 1e3 / per:.2f} {unit}; ops overlapping on "
            f"several streams: {(total - busy) / 1e3 / per:.2f} {unit} "
            f"({(total - busy) / max(total, 1e-9):.1%} of op time)"
        ),
        "",
        f"{'category':<14} {unit:>10} {'share':>7}",
    ]
    for cat, dur in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"{cat:<14} {dur / 1e3 / per:>10.3f} {dur / max(total, 1e-9):>7.1%}")
    lines += ["", f"{unit:>10} {'share':>7} {'calls':>6}  category      {where} op / kernel"]
    for name, (dur, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        short = name if len(name) <= 120 else name[:117] + "..."
        src = f"  <- {sources[_norm(name)]}" if _norm(name) in sources else ""
        lines.append(
            f"{dur / 1e3 / per:>10.3f} {dur / max(total, 1e-9):>7.1%} {n:>6}  "
            f"{category(name):<13} {short}{src}"
        )
    return "\n".join(lines) + "\n"


@command("sluice-profile")
def main(argv=None) -> int:
    p = Parser(prog="sluice-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir", help="the directory jax.profiler wrote (RUN_DIR/profile)")
    p.add_argument("--steps", type=positive_int, help="steps traced: figures per step")
    p.add_argument("--top", type=positive_int, default=40, help="ops listed")
    a = p.parse_args(argv)
    if not os.path.isdir(a.trace_dir):
        p.error(f"argument trace_dir: {a.trace_dir} is not a directory")
    try:
        text = summarize(a.trace_dir, a.steps, a.top)
    except FileNotFoundError as e:
        raise UsageError(str(e).removeprefix("sluice-profile: ")) from None
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What XLA scheduled inside each async pair of an optimized HLO dump.

    python bench/hlo_async.py MODULE.after_optimizations.txt [--kind call]

For every `<kind>-start` (default `async-start`) in a computation's schedule (the entry's, a loop body's) (e.g. a `call-start` that XLA made of a
jax compute_on("gpu_stream:N") region: sluice.ep's exchange with setup(stream=N)), prints what the
async op wraps and the instructions scheduled between the start and its `-done` that do work
(fusions, custom calls, GEMMs), so one can see whether XLA gave the stream anything to overlap."""

from __future__ import annotations

import argparse
import re
import sys

WORK = re.compile(r"\b(fusion|custom-call|convolution|dot|all-reduce|all-gather|reduce-scatter)\(")
NAME = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=")


def computations(text: str) -> list[tuple[str, list[str]]]:
    """(name, instructions in schedule order) of every computation of the module."""
    found = re.findall(r"^(?:ENTRY )?(%?[\w.\-]+) .*?\{\n(.*?)^\}", text, re.DOTALL | re.MULTILINE)
    return [(n, [ln for ln in body.splitlines() if NAME.match(ln)]) for n, body in found]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo")
    p.add_argument(
        "--kind", default="async", help="async op kind (async: a wrapped call; all-reduce, ...)"
    )
    a = p.parse_args(argv)
    with open(a.hlo) as f:
        comps = computations(f.read())
    if not comps:
        sys.exit(f"{a.hlo}: no HLO computations found")
    start_re = re.compile(rf"\b{re.escape(a.kind)}-start\(")
    pairs = overlapped = 0
    for comp, lines in comps:
        p, o = pairs_in(comp, lines, start_re, a.kind)
        pairs, overlapped = pairs + p, overlapped + o
    print(f"# {pairs} {a.kind}-start/done pairs, {overlapped} with work scheduled between them")


def pairs_in(comp: str, lines: list[str], start_re, kind: str) -> tuple[int, int]:
    open_: dict[str, tuple[int, str]] = {}
    pairs = overlapped = 0
    for i, ln in enumerate(lines):
        name = NAME.match(ln).group(1).lstrip("%")
        if start_re.search(ln):
            what = re.search(r"calls=(%?[\w.\-]+)|to_apply=(%?[\w.\-]+)", ln)
            open_[name] = (i, (what.group(1) or what.group(2)) if what else "?")
            continue
        m = re.search(rf"\b{re.escape(kind)}-done\((?:[^%]*)%?([\w.\-]+)", ln)
        if m and m.group(1) in open_:
            j, what = open_.pop(m.group(1))
            between = [
                NAME.match(x).group(1).lstrip("%") for x in lines[j + 1 : i] if WORK.search(x)
            ]
            pairs += 1
            overlapped += bool(between)
            shown = ", ".join(between[:6]) + (f", ... ({len(between)})" if len(between) > 6 else "")
            print(f"{comp}: {m.group(1)} [{what}]: {len(between)} ops between: {shown}")
    return pairs, overlapped


if __name__ == "__main__":
    main()

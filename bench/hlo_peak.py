"""What is live at the peak of a compiled XLA module's temporary memory, by value and by the JAX
operation that made it.

    python3 bench/hlo_peak.py DUMP_DIR [--module train_step] [--top 30]

DUMP_DIR is an --xla_dump_to folder (bench/mem_report.sh makes one). The module's optimised HLO
gives the schedule (the entry computation's order) and each instruction's op_name; its buffer assignment
gives the values of the temporary allocation and their sizes. A value is live from the instruction
that defines it to its last use (through get-tuple-element, bitcast and tuple aliases; a value made
inside a called computation, e.g. a command buffer, lives at its call, and past it if it is the
call's result). XLA's memory-usage report lists slices by offset, not time; this lists the values
that are live together at the peak, so one can tell a forward pass's residuals (op_name "jvp(...)")
from a backward pass's temporaries ("transpose(jvp(...))").
"""

import argparse
import collections
import glob
import re
import sys

_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_REF = re.compile(r"%([\w.\-]+)")
_USE = re.compile(r"%([\w.\-]+)(?:#(\d+))?")  # %x#1: element 1 of the tuple x
_GTE_INDEX = re.compile(r"get-tuple-element\(.*\bindex=(\d+)")
_CALLS = re.compile(
    r"(?:calls|to_apply|body|condition|async_execution_thread|called_computations|"
    r"branch_computations)=\{?([%\w.\-, ]+)\}?"
)
_OPNAME = re.compile(r'op_name="([^"]*)"')
_VALUE = re.compile(r"value: <\d+ ([\w.\-]+)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def parse_hlo(path):
    """-> (computations {name: [(instr, text, is_root)]}, the entry's name)."""
    comps, entry, cur = {}, None, None
    with open(path) as f:
        for line in f:
            m = _COMP.match(line)
            if m and "=" not in line.split("{")[0].split("(")[0]:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
                continue
            if line.startswith("}"):
                cur = None
                continue
            if cur is None:
                continue
            m = _INSTR.match(line)
            if m:
                comps[cur].append((m.group(2), m.group(3), bool(m.group(1))))
    if entry is None:
        raise SystemExit(f"hlo_peak: no ENTRY computation in {path}")
    return comps, entry


def live_ranges(comps, entry):
    """-> (range, {instr: op_name}): range(instr, tuple index or None) is the value's (def index,
    last-use index) in the entry's schedule. A use of a whole tuple keeps each element alive; a
    get-tuple-element, bitcast or tuple keeps what it names alive as long as it lives itself."""
    order = comps[entry]
    index = {name: i for i, (name, _, _) in enumerate(order)}
    last, last_any = {}, {}

    def use(key, i):
        last[key] = max(last.get(key, -1), i)
        last_any[key[0]] = max(last_any.get(key[0], -1), i)

    op_name = {}
    for comp in comps.values():
        for name, text, _ in comp:
            m = _OPNAME.search(text)
            op_name[name] = m.group(1) if m else ""
    aliases = []  # (alias, [the (instr, index) it names])
    for i, (name, text, is_root) in enumerate(order):
        body = text.split(", metadata=")[0]
        operands = body.split("(", 1)[1] if "(" in body else ""
        refs = [(r, int(k) if k else None) for r, k in _USE.findall(operands) if r in index]
        for key in refs:
            use(key, i)
        if is_root:
            use((name, None), len(order))
        gte = _GTE_INDEX.search(body)
        if gte and len(refs) == 1 and refs[0][1] is None:
            aliases.append((name, [(refs[0][0], int(gte.group(1)))]))
        elif re.search(r"\s(bitcast|tuple)\(", body):
            aliases.append((name, refs))
    for name, srcs in reversed(aliases):
        for key in srcs:
            use(key, last_any.get(name, index[name]))
    # values made inside called computations: at their call (past it if they are its result)
    inner = {}
    for i, (name, text, _) in enumerate(order):
        for group in _CALLS.findall(text):
            stack, seen = _REF.findall(group) or [group.strip()], set()
            while stack:
                c = stack.pop()
                if c in seen or c not in comps:
                    continue
                seen.add(c)
                for iname, itext, iroot in comps[c]:
                    inner.setdefault(iname, (i, last_any.get(name, i) if iroot else i))
                    for g in _CALLS.findall(itext):
                        stack.extend(_REF.findall(g))

    def live(name, k=None):
        if name in index:
            end = max(index[name], last.get((name, None), -1), last.get((name, k), -1))
            return index[name], end
        return inner.get(name)

    return live, op_name


def temp_values(path):
    """The preallocated-temp allocation's values."""
    values, inside = [], False  # (instr, tuple index or None, size, offset, shape)
    with open(path) as f:
        for line in f:
            if line.startswith("allocation "):
                inside = "preallocated-temp" in line
                continue
            if inside:
                m = _VALUE.search(line)
                if m:
                    k = m.group(2)
                    k = int(k.strip("{}").split(",")[0]) if k and k != "{}" else None
                    values.append((m.group(1), k, int(m.group(3)), int(m.group(4)), m.group(5)))
    return values


def short(op_name, n=110):
    op_name = op_name.replace("jit(train_step)/", "")
    return op_name if len(op_name) <= n else "..." + op_name[-n:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--module", default="train_step")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    hlo = glob.glob(f"{a.dump}/*{a.module}*after_optimizations.txt")
    ba = glob.glob(f"{a.dump}/*{a.module}*after_optimizations-buffer-assignment.txt")
    if not hlo or not ba:
        raise SystemExit(
            f"hlo_peak: no optimised HLO or buffer assignment of *{a.module}* in {a.dump}"
        )
    comps, entry = parse_hlo(min(hlo))
    live, op_name = live_ranges(comps, entry)
    values = temp_values(min(ba))
    known = [(name, size, shape, live(name, k)) for name, k, size, _, shape in values]
    known = [v for v in known if v[3] is not None]
    n = len(comps[entry])
    delta = [0] * (n + 2)
    for _, size, _, (d, l) in known:
        delta[d] += size
        delta[l + 1] -= size
    running, peak, at = 0, -1, 0
    for i in range(n + 1):
        running += delta[i]
        if running > peak:
            peak, at = running, i
    total = sum(v[2] for v in values)
    where = comps[entry][at][0] if at < n else "end"
    print(f"{min(hlo)}")
    print(
        f"temporary values {total / 2**30:.2f} GiB summed ({len(values)}, {len(values) - len(known)} "
        f"not placed); live at once at most {peak / 2**30:.2f} GiB, at step {at} of {n}: "
        f"{where} ({short(op_name.get(where, ''))})"
    )
    here = sorted(
        ((size, name, shape, r) for name, size, shape, r in known if r[0] <= at <= r[1]),
        reverse=True,
    )
    groups = collections.Counter()
    for size, name, shape, _ in here:
        tag = "backward" if "transpose(" in op_name.get(name, "") else "forward"
        groups[(shape.split("{")[0], tag)] += size
    print("\nlive at the peak, by shape and pass (GiB):")
    for (shape, tag), size in groups.most_common(a.top):
        print(f"  {size / 2**30:8.3f}  {tag:8s}  {shape}")
    print(f"\nthe {a.top} largest values live at the peak (size GiB, def..last use, op_name):")
    for size, name, shape, (d, l) in here[: a.top]:
        print(
            f"  {size / 2**30:7.3f}  {d:6d}..{l:<6d} {shape.split('{')[0]:24s} {name}: {short(op_name.get(name, ''))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the sluice-* commands share for user errors: each ends in one line, ``PROG: error: WHAT``,
naming the flag or file and what was expected, with exit code 2 and no traceback (argparse's
convention, without its usage block)."""

from __future__ import annotations

import argparse
import functools
import math
import sys


class UsageError(Exception):
    """A user error found after parsing (a file, the devices, a run directory). A command's main()
    prints its message as one line and exits 2; the message names the flag or file."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``prog: error: message``, and exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def command(prog: str):
    """Wraps a main(argv): a UsageError it raises becomes one line on stderr and exit code 2."""

    def wrap(fn):
        @functools.wraps(fn)
        def main(argv=None):
            try:
                return fn(argv)
            except UsageError as e:
                sys.stderr.write(f"{prog}: error: {e}\n")
                raise SystemExit(2) from None

        return main

    return wrap


def _bounded(kind, lo=None, hi=None, above=None):
    """An argparse type: a `kind` (int or float) value within [lo, hi], or greater than `above`."""
    if above is not None:
        want = f"a number > {above:g}"
    elif hi is None:
        want = f"an integer >= {lo}" if kind is int else f"a number >= {lo:g}"
    else:
        want = f"an integer from {lo} to {hi}"

    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        ok = math.isfinite(v) and (
            v > above if above is not None else v >= lo and (hi is None or v <= hi)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return v

    parse.__name__ = want
    return parse


positive_int = _bounded(int, lo=1)
nonneg_int = _bounded(int, lo=0)
positive_float = _bounded(float, above=0)
nonneg_float = _bounded(float, lo=0)


def int_range(lo: int, hi: int):
    return _bounded(int, lo=lo, hi=hi)

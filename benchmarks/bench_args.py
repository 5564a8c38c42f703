"""The benchmarks' command lines: a parser described by the script's docstring, its options
added from a table, one row per option.

A row is ``(flag, kind, default, help)``. ``kind`` is ``int`` or ``float`` (the value is
converted), ``str`` (kept as typed), ``bool`` (a switch, off unless given) or a tuple of the
values the option accepts; ``help`` may be None (no help line) or ``argparse.SUPPRESS``
(an internal option, left out of ``--help``).
"""

from __future__ import annotations

import argparse


def parser(doc, first_line=False, show_defaults=False):
    """An ArgumentParser described by the first paragraph of ``doc`` (its first line with
    ``first_line``); ``show_defaults`` appends every option's default to its help."""
    description = doc.splitlines()[0] if first_line else doc.split("\n\n")[0]
    formatter = argparse.ArgumentDefaultsHelpFormatter if show_defaults else argparse.HelpFormatter
    return argparse.ArgumentParser(description=description, formatter_class=formatter)


def add_options(ap, rows):
    """Add one option to ``ap`` per row of ``rows``, in order (the order of ``--help``)."""
    for flag, kind, default, help_text in rows:
        if kind is bool:
            ap.add_argument(flag, action="store_true", help=help_text)
        elif isinstance(kind, tuple):
            ap.add_argument(flag, choices=kind, default=default, help=help_text)
        else:
            ap.add_argument(flag, type=None if kind is str else kind, default=default, help=help_text)
    return ap


def positive_or_exit(ap, args, names):
    """Exit through ``ap.error`` when an option of ``names`` (attribute names) is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

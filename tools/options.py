"""Numeric and string command-line options from a table, for the scripts with many knobs
(benchmarks, model builders): one keyword per option instead of one add_argument each."""

from __future__ import annotations

import argparse


def add_options(parser: argparse.ArgumentParser, **options: object) -> None:
    """``name=default`` or ``name=(default, help)`` adds ``--name`` (underscores become
    dashes) of the default's type (int, float or str), which converts the command line."""
    for name, spec in options.items():
        default, help_text = spec if isinstance(spec, tuple) else (spec, None)
        if type(default) not in (int, float, str):  # a bool would make "--x false" true
            raise TypeError(f"--{name}: the default must be an int, float or str, got {default!r}")
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, help=help_text)

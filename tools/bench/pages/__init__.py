"""The results pages (docs/results/<page>.md) rendered from the committed records
(tools/bench/results/*.json) through their templates (tools/bench/pages/<page>.md):

    python -m rlfleet.tools.bench.pages            # write every page that has a template
    python -m rlfleet.tools.bench.pages --check    # exit 1 naming each page that differs

A template is the page's markdown with every measured figure a placeholder, so no
figure is ever typed by hand and a page cannot drift from its records:

    {{ losses.json | summary.frozenlake.ppo_clip.mean | .3f }}

the record (a file in tools/bench/results), a path into it (keys and list indices joined
by dots) and a format spec (Python's format mini-language; none: ``str``). What is
computed from a record (a table, a minimum over runs) is a filler: a function registered
with ``@filler`` in ``tools/bench/pages/fill_<page>.py``, given a function that returns a
record by file name, and the placeholder's arguments, if any, as strings:
``{{ fill:losses_table }}``, ``{{ fill:learning_table | learning_hog.json }}``.
``{{ generated }}`` says which command wrote the page and from which records.

The README's results table is rendered the same way, from tools/bench/pages/readme/results.md,
between two markers in README.md. drops.md and soak.md have renderers of their own
(``--render`` of their benchmarks); tests/tools/bench/test_pages.py holds every page under
docs/results to one of the two.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
RECORDS = ROOT / "tools" / "bench" / "results"
TEMPLATES = Path(__file__).resolve().parent
PAGES = ROOT / "docs" / "results"
COMMAND = "python -m rlfleet.tools.bench.pages"
README = ROOT / "README.md"
README_TEMPLATE = TEMPLATES / "readme" / "results.md"
BEGIN = f"<!-- the results table: `{COMMAND}` from tools/bench/pages/readme/results.md -->"
END = "<!-- end of the results table -->"
# Pages rendered by their own benchmark's --render (named on the page).
OWN_RENDERER = {"drops.md": "python -m rlfleet.tools.bench.drops --render",
                "soak.md": "python -m rlfleet.tools.bench.soak --render"}
# Pages still written by hand, each with why: tests/tools/bench/test_pages.py fails on a
# page that is in none of the three, and on one listed here that has a template.
NOT_YET_RENDERED: dict[str, str] = {}  # none since the long-tail records were committed

# Records a page outside docs/results cites (its figures still typed there): the test
# fails on a record that no page reads and that is not listed here with the page that names it.
CITED_ELSEWHERE = {"learning_three_task_model.json": "docs/guide/models.md",
                   "unit_security.json": "systemd/README.md", "unit_security_sandbox.json": "systemd/README.md"}

PLACEHOLDER = re.compile(r"\{\{\s*(.*?)\s*\}\}")

Records = Callable[[str], Any]  # a record by file name, parsed
Filler = Callable[..., str]      # (records, *the placeholder's arguments) -> markdown
FILLERS: dict[str, Filler] = {}


class PageError(ValueError):
    """A placeholder that names no record, no key or no filler: the page is not written."""


def filler(fn: Filler) -> Filler:
    """Register ``fn`` as ``{{ fill:<its name> }}``."""
    FILLERS[fn.__name__] = fn
    return fn


def span(values: list[float], spec: str = ".0f", sep: str = "–") -> str:
    """``min–max`` of ``values`` in ``spec`` (the fillers' ranges); one figure where both read the same."""
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}{sep}{high}"


def median_span(stat: dict[str, Any] | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """``median (min–max)`` of a summary cell ({"median", "min", "max"}) in ``spec``, each
    figure times ``scale``; the median alone where the range reads as one figure; – for None."""
    if stat is None:
        return "–"
    median = format(stat["median"] * scale, spec)
    rng = span([stat["min"] * scale, stat["max"] * scale], spec)
    return median + suffix if rng == median else f"{median}{suffix} ({rng})"


def lookup(value: Any, path: str, where: str) -> Any:
    """``value`` at ``path`` (keys and list indices joined by dots)."""
    for part in path.split(".") if path else []:
        if isinstance(value, list) and re.fullmatch(r"-?\d+", part) and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise PageError(f"{where}: no {part!r} at {path!r}")
    return value


def render(template: str, name: str, records_dir: Path = RECORDS, read: set[str] | None = None) -> str:
    """The page ``name`` from its template's text; PageError on a placeholder that does
    not resolve (the message names the template, the placeholder and what is missing).
    ``read``: a set the names of the records the page read are added to."""
    load_fillers()
    cache: dict[str, Any] = {}

    def record(file: str) -> Any:
        if file not in cache:
            path = records_dir / file
            if not path.is_file():
                raise PageError(f"{name}: no record {file} in {records_dir}")
            cache[file] = json.loads(path.read_text())
        return cache[file]

    def one(match: re.Match[str]) -> str:
        text = match.group(1)
        where = f"{name}: {{{{ {text} }}}}"
        if text == "generated":
            return "\0generated\0"  # after the rest: it lists the records the page read
        parts = [p.strip() for p in text.split("|")]
        if text.startswith("fill:"):
            fn = FILLERS.get(parts[0].removeprefix("fill:"))
            if fn is None:
                raise PageError(f"{where}: no filler of that name (known: {', '.join(sorted(FILLERS))})")
            return fn(record, *parts[1:])
        if len(parts) not in (2, 3):
            raise PageError(f"{where}: expected {{{{ record.json | path | format }}}}")
        value = lookup(record(parts[0]), parts[1], where)
        try:
            return format(value, parts[2]) if len(parts) == 3 else str(value)
        except (TypeError, ValueError) as exc:
            raise PageError(f"{where}: {value!r} does not take the format {parts[2]!r}: {exc}") from None

    body = PLACEHOLDER.sub(one, template)
    if read is not None:
        read.update(cache)
    used = ", ".join(f"`tools/bench/results/{f}`" for f in sorted(cache)) or "no record"
    return body.replace("\0generated\0", f"Generated by `{COMMAND}` from {used} and the template "
                                         f"`tools/bench/pages/{name}` (edit that, not this page).")


def templates() -> list[Path]:
    return sorted(TEMPLATES.glob("*.md"))


def with_table(readme: str, table: str) -> str:
    """``readme`` with what stands between BEGIN and END replaced by ``table``."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise PageError(f"README.md: the markers {BEGIN!r} and {END!r} must stand around the results table")
    return readme[:start + len(BEGIN)] + "\n" + table.strip("\n") + "\n" + readme[end:]


def rendered(read: set[str] | None = None) -> dict[Path, str]:
    """What every generated file must hold: each templated page, and README.md with its
    table (``read``: collects the names of the records they read)."""
    load_fillers()
    out = {PAGES / t.name: render(t.read_text(), t.name, read=read) for t in templates()}
    if README_TEMPLATE.exists():
        table = render(README_TEMPLATE.read_text(), "readme/results.md", read=read)
        out[README] = with_table(README.read_text(), table)
    return out


def load_fillers() -> None:
    """Import every fill_<page>.py beside this module (each registers its fillers)."""
    for module in pkgutil.iter_modules([str(TEMPLATES)]):
        if module.name.startswith("fill_"):
            importlib.import_module(f"{__name__}.{module.name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--check"]):
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    try:
        expected = rendered()
    except PageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    differ = []
    for path, text in expected.items():
        if path.exists() and path.read_text() == text:
            continue
        if argv == ["--check"]:
            differ.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if differ:
        print(f"differ from their records: {', '.join(differ)} (run {COMMAND})", file=sys.stderr)
        return 1
    return 0

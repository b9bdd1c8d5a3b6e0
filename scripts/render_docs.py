"""Render the README tables that come from result files, from those files (`make docs`, `make docs-check`).

A rendered block sits between two marker lines, each alone on its line and not indented:

    <!-- render: benchmarks/results/s3agg-paths.json table -->
    ... what `make docs` writes: a line naming the file, then the rendering ...
    <!-- /render -->

The opening marker names the result file (relative to the repository root), then a renderer (a key of
RENDERERS), then options as key=value (double quotes around a value with spaces; shell-like splitting).
Every renderer takes `only=N`: keep only the N-th Markdown table of its rendering. `make docs` rewrites
what lies between the markers; `--check` (`make docs-check`) changes nothing, prints a unified diff for
every Markdown file whose blocks differ from their renderings and exits 1.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from _common import markdown_table  # noqa: E402  (the benchmarks' own table layout)

logger = logging.getLogger(__name__)

OPEN = re.compile(r"^<!-- render: (?P<spec>.+) -->$")
CLOSE = "<!-- /render -->"
# Hold no Markdown with markers; dot folders (.venv, .git: seconds to walk) are skipped as well.
SKIPPED_DIRS = {"build", "results", "node_modules", "__pycache__"}


class RenderError(Exception):
    """A marker that cannot be rendered; the message names the Markdown file, the line and the cause."""


@dataclass(frozen=True)
class Renderer:
    render: Callable[[Path, dict[str, str]], str]
    options: frozenset[str]


RENDERERS: dict[str, Renderer] = {}


def renderer(name: str, *options: str) -> Callable[[Callable[[Path, dict[str, str]], str]], Callable]:
    """Register a function (result file, options) -> Markdown under ``name``, taking ``options`` besides `only`."""

    def register(function: Callable[[Path, dict[str, str]], str]) -> Callable:
        RENDERERS[name] = Renderer(function, frozenset(options))
        return function

    return register


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@renderer("table")
def json_table(path: Path, options: dict[str, str]) -> str:
    """What the benchmark printed when it wrote the file: the JSON's `table` field."""
    data = _json(path)
    if not isinstance(data.get("table"), str):
        raise RenderError(f"{path.name} has no 'table' field")
    return data["table"]


@renderer("markdown", "heading")
def markdown_file(path: Path, options: dict[str, str]) -> str:
    """A result `.md` file (dualpath-bench*.md, simulate-*.md, ...) without its title: with `heading`, the body of
    that `## ` section alone, else what precedes the first `## ` section."""
    heading = options.get("heading")
    body: list[str] | None = None if heading else []
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            if body is not None:
                break
            if line[3:].strip() == heading:
                body = []
        elif body is not None and not line.startswith("# "):
            body.append(line)
    if body is None:
        raise RenderError(f"{path.name} has no section '## {heading}'")
    return "\n".join(body).strip()


# The three measurements of mma_preload/gpu_check.sh in a device-check log, one JSON object per line.
MMA_RUNS = {"native": "native:", "preloaded": "preloaded:", "engine on the one link": "engine, one path (MMA_SINGLE_PATH=1):"}
MMA_COPIES = {"small_h2d_gbps": "1 MiB H2D", "small_d2h_gbps": "1 MiB D2H",
              "large_h2d_gbps": "256 MiB H2D", "large_d2h_gbps": "256 MiB D2H"}


@renderer("mma-gpu-check")
def mma_gpu_check(path: Path, options: dict[str, str]) -> str:
    """mma_preload/gpu_check.sh's copy rates, native vs preloaded vs the engine forced on the one link."""
    runs: dict[str, dict] = {}
    checks = []  # the correctness run's verdict line, quoted as gpu_check.sh printed it
    for line in path.read_text().splitlines():
        if line.strip().startswith("byte mismatches:"):
            checks.append(line.strip())
        for name, prefix in MMA_RUNS.items():
            if line.startswith(prefix):
                runs[name] = json.loads(line[len(prefix):])
    missing = [MMA_RUNS[name] for name in MMA_RUNS if name not in runs]
    if missing:
        raise RenderError(f"{path.name} has no line starting {', '.join(missing)}")
    native = runs["native"]
    others = list(MMA_RUNS)[1:]
    rows = [[copy, f"{native[key]:.2f}", *(f"{runs[name][key]:.2f} ({runs[name][key] / native[key]:.1%})" for name in others)]
            for key, copy in MMA_COPIES.items()]
    caption = (f"{native['device']}, {native['ndev']} GPU(s). Correctness (preloaded): {'; '.join(checks) or 'not in the log'}. "
               "Copy rates: the engine forced on the GPU's one link by `MMA_SINGLE_PATH=1`; preloaded / native in brackets.")
    return markdown_table(["copy (pinned, one stream)", "native GB/s", *(f"{name} GB/s" for name in others)], rows, caption)


def only_table(text: str, number: int) -> str:
    """The ``number``-th (1-based) Markdown table of ``text``."""
    tables = [block for block in re.split(r"\n\s*\n", text) if block.lstrip().startswith("|")]
    if not 1 <= number <= len(tables):
        raise RenderError(f"only={number}, but the rendering has {len(tables)} table(s)")
    return tables[number - 1].strip()


@dataclass(frozen=True)
class Marker:
    source: str
    renderer: str
    options: dict[str, str]

    @classmethod
    def parse(cls, spec: str) -> Marker:
        try:
            words = shlex.split(spec)
        except ValueError as error:
            raise RenderError(f"marker '{spec}': {error}") from None
        if len(words) < 2:
            raise RenderError(f"marker '{spec}' needs a result file and a renderer")
        options = {}
        for word in words[2:]:
            key, sep, value = word.partition("=")
            if not sep:
                raise RenderError(f"option '{word}' is not key=value")
            options[key] = value
        return cls(words[0], words[1], options)

    def render(self, root: Path, markdown_file: Path) -> str:
        path = root / self.source
        if not path.is_file():
            raise RenderError(f"result file {self.source} does not exist")
        if self.renderer not in RENDERERS:
            raise RenderError(f"unknown renderer '{self.renderer}' (known: {', '.join(sorted(RENDERERS))})")
        chosen = RENDERERS[self.renderer]
        unknown = set(self.options) - chosen.options - {"only"}
        if unknown:
            raise RenderError(f"renderer '{self.renderer}' takes no option {', '.join(sorted(unknown))}")
        text = chosen.render(path, self.options).strip()
        if "only" in self.options:
            if not self.options["only"].isdigit():
                raise RenderError(f"only={self.options['only']} is not a table number")
            text = only_table(text, int(self.options["only"]))
        link = os.path.relpath(path, markdown_file.parent)
        return f"*From [`{self.source}`]({link}), rendered by `make docs`.*\n\n{text}\n"


def render_markdown(text: str, markdown_file: Path, root: Path) -> str:
    """``text`` with every marked block replaced by its rendering."""
    out: list[str] = []
    opened_at: int | None = None
    name = markdown_file.relative_to(root)
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        stripped = line.rstrip("\n")
        match = OPEN.match(stripped)
        where = f"{name}:{number}"
        if match:
            if opened_at is not None:
                raise RenderError(f"{where}: a render marker inside the one opened at line {opened_at}")
            opened_at = number
            out.append(line)
            try:
                out.append(Marker.parse(match["spec"]).render(root, markdown_file))
            except RenderError as error:
                raise RenderError(f"{where}: {error}") from None
        elif stripped == CLOSE:
            if opened_at is None:
                raise RenderError(f"{where}: {CLOSE} without an opening marker")
            opened_at = None
            out.append(line)
        elif opened_at is None:
            out.append(line)
    if opened_at is not None:
        raise RenderError(f"{name}:{opened_at}: render marker never closed")
    return "".join(out)


def marked_files(root: Path) -> Iterator[Path]:
    """The Markdown files under ``root`` that hold a render marker."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in SKIPPED_DIRS)
        for name in sorted(files):
            path = Path(directory) / name
            if name.endswith(".md") and "<!-- render: " in path.read_text():
                yield path


def stale(root: Path) -> dict[Path, str]:
    """Per Markdown file whose blocks differ from their renderings: the file as it renders."""
    out = {}
    for path in marked_files(root):
        rendered = render_markdown(path.read_text(), path, root)
        if rendered != path.read_text():
            out[path] = rendered
    return out


def unified_diff(path: Path, rendered: str, root: Path) -> str:
    name = str(path.relative_to(root))
    return "".join(difflib.unified_diff(path.read_text().splitlines(keepends=True), rendered.splitlines(keepends=True),
                                        f"{name} (committed)", f"{name} (rendered)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; print a diff and exit 1 on drift")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        renderings = stale(args.root)
    except RenderError as error:
        logger.error("render_docs: %s", error)
        return 2
    for path, rendered in renderings.items():
        if args.check:
            sys.stdout.write(unified_diff(path, rendered, args.root))
        else:
            path.write_text(rendered)
            logger.info("rendered %s", path.relative_to(args.root))
    if args.check and renderings:
        logger.error("render_docs: %d file(s) differ from their result files; run `make docs`", len(renderings))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

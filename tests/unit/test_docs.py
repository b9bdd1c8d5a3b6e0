"""scripts/render_docs.py: every README block marked as rendered matches what its result file renders (the check
`make docs-check` runs), and the renderer itself: drift shows as a diff, a bad marker names what is wrong,
rendering twice changes nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import render_docs  # noqa: E402

TABLE = "Caption.\n\n| a | b |\n|--:|--:|\n| 1 | 2 |"


def test_readmes_match_their_result_files():
    stale = render_docs.stale(REPO_ROOT)
    diffs = "".join(render_docs.unified_diff(path, rendered, REPO_ROOT) for path, rendered in stale.items())
    assert not stale, f"READMEs differ from their result files; run `make docs`:\n{diffs}"


def test_the_repository_has_rendered_blocks():
    # A marker syntax that stopped matching would make the check above pass on nothing.
    assert REPO_ROOT / "benchmarks" / "README.md" in set(render_docs.marked_files(REPO_ROOT))


def project(tmp_path: Path, readme: str, table: str = TABLE) -> Path:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text(json.dumps({"table": table}))
    (tmp_path / "docs").mkdir()
    path = tmp_path / "docs" / "README.md"
    path.write_text(readme)
    return path


def marked(body: str, spec: str = "results/run.json table") -> str:
    return f"# Title\n\nProse.\n\n<!-- render: {spec} -->\n{body}<!-- /render -->\n\nMore prose.\n"


def test_a_drifted_table_is_reported_with_a_diff(tmp_path):
    path = project(tmp_path, marked(""))
    render_docs.main(["--root", str(tmp_path)])
    path.write_text(path.read_text().replace("| 1 | 2 |", "| 1 | 3 |"))  # a hand edit, or an older run's figure
    stale = render_docs.stale(tmp_path)
    assert list(stale) == [path]
    diff = render_docs.unified_diff(path, stale[path], tmp_path)
    assert "-| 1 | 3 |\n" in diff and "+| 1 | 2 |\n" in diff
    assert render_docs.main(["--root", str(tmp_path), "--check"]) == 1
    assert path.read_text().count("| 1 | 3 |") == 1  # --check changes nothing


def test_rendering_names_the_file_and_is_idempotent(tmp_path):
    path = project(tmp_path, marked("stale text\n"))
    assert render_docs.main(["--root", str(tmp_path)]) == 0
    once = path.read_text()
    assert "stale text" not in once and "| 1 | 2 |" in once
    assert "[`results/run.json`](../results/run.json)" in once
    assert once.startswith("# Title\n\nProse.\n") and once.endswith("<!-- /render -->\n\nMore prose.\n")
    assert render_docs.main(["--root", str(tmp_path)]) == 0
    assert path.read_text() == once
    assert render_docs.main(["--root", str(tmp_path), "--check"]) == 0


def test_only_keeps_one_table(tmp_path):
    path = project(tmp_path, marked("", "results/run.json table only=2"), TABLE + "\n\nSecond.\n\n| c |\n|---|\n| x |")
    render_docs.main(["--root", str(tmp_path)])
    assert "| x |" in path.read_text() and "| 1 | 2 |" not in path.read_text() and "Second." not in path.read_text()


@pytest.mark.parametrize(("spec", "message"), [
    ("results/gone.json table", "result file results/gone.json does not exist"),
    ("results/run.json tabel", "unknown renderer 'tabel'"),
    ("results/run.json table colour=red", "renderer 'table' takes no option colour"),
    ("results/run.json table only=3", "only=3, but the rendering has 1 table(s)"),
])
def test_a_bad_marker_is_an_error_naming_it(tmp_path, spec, message):
    project(tmp_path, marked("", spec))
    with pytest.raises(render_docs.RenderError, match="docs/README.md:5: " + message.replace("(", r"\(").replace(")", r"\)")):
        render_docs.stale(tmp_path)
    assert render_docs.main(["--root", str(tmp_path), "--check"]) == 2


def test_an_unclosed_marker_is_an_error(tmp_path):
    project(tmp_path, "<!-- render: results/run.json table -->\n| old |\n")
    with pytest.raises(render_docs.RenderError, match="docs/README.md:1: render marker never closed"):
        render_docs.stale(tmp_path)

"""The suite's file order (tests/conftest.py): the committed durations name real modules, longest first."""

from __future__ import annotations

from tests.conftest import MODULE_SECONDS_FILE, REPO_ROOT, measured_module_seconds


def test_the_committed_durations_order_existing_modules():
    seconds = measured_module_seconds(MODULE_SECONDS_FILE.read_text())
    assert len(seconds) >= 20
    for module in seconds:
        assert (REPO_ROOT / (module.replace(".", "/") + ".py")).is_file(), module
    # The order the run gets: an e2e module first (the engine-heavy ones are the long ones).
    assert max(seconds, key=seconds.get).startswith("tests.e2e.")


def test_lines_outside_the_section_or_not_a_module_are_skipped():
    text = ("# slowest\n  99.0 tests.e2e.test_x\n# seconds per test module (...)\n   12.5 tests.e2e.test_a\n"
            "    3.0 tests.unit.test_b\n  3896.9 all modules\n")  # fmt: skip
    assert measured_module_seconds(text) == {"tests.e2e.test_a": 12.5, "tests.unit.test_b": 3.0}

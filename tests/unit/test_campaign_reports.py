"""What the campaigns print from their tools' output (the campaigns themselves run in tests/live)."""

from __future__ import annotations

from gyrfalcon.campaigns.fuzz import _phases, _summary

#: Schemathesis 4.32's output, abridged (a run over two operations)
OUTPUT = """Schemathesis v4.32.5
 ✅  Loaded specification from http://127.0.0.1:8123/openapi.json (in 0.39s)

     Operations:       2 selected / 10 total

 ⏭   Examples (in 0.01s)

     ⏭  2 skipped

 ✅  Coverage (in 0.11s)

     ✅ 2 passed

 ❌  Fuzzing (in 12.04s)

     ✅ 1 passed  ❌ 1 failed

=================================== SUMMARY ====================================

API Operations:
  Selected: 2/10
  Tested: 2

Test cases:
  20 generated, 19 passed, 1 failed

Seed: 330970587419955987254746756981601971077

=========================== 1 failure in 12.6s ===========================
"""


def test_the_fuzz_report_keeps_each_phase_and_the_summary_without_the_seed():
    assert _phases(OUTPUT) == ["⏭   Examples (in 0.01s): ⏭  2 skipped", "✅  Coverage (in 0.11s): ✅ 2 passed",
                               "❌  Fuzzing (in 12.04s): ✅ 1 passed  ❌ 1 failed"]  # fmt: skip
    summary = _summary(OUTPUT)
    assert summary[:3] == ["API Operations:", "  Selected: 2/10", "  Tested: 2"]
    assert "  20 generated, 19 passed, 1 failed" in summary and summary[-1].startswith("===") and "1 failure" in summary[-1]
    assert not any("Seed" in line for line in summary)


def test_without_a_summary_section_the_counted_lines_remain():
    assert _summary("  12 generated, 12 passed\nNo issues found in 3s\n") == ["12 generated, 12 passed", "No issues found in 3s"]

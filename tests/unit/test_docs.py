"""The docs: the pages written from the code are current, the site builds strictly (no broken link
or anchor), and the README stays one screen or two."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_pages_written_from_the_code_are_current():
    from gyrfalcon import reference

    for name, render in reference.PAGES.items():
        with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
            assert f.read() == render(), f"docs/{name} is stale: run python -m gyrfalcon.reference"


def test_every_serve_option_is_on_the_configuration_page():
    import argparse

    from gyrfalcon.compose import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        page = f.read()
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 50 and all(f"| `{flag}` |" in page for flag in flags)


def test_the_docs_site_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_the_readme_is_one_screen_or_two():
    assert os.path.getsize(os.path.join(ROOT, "README.md")) <= 12 * 1024

"""Regenerate ``gyrfalcon/generated/`` from the OpenAPI documents in ``gyrfalcon/openapi/``.

Usage::

    python -m gyrfalcon.codegen            # rewrite the generated modules
    python -m gyrfalcon.codegen --check    # exit 1 with a unified diff when they are stale

One module per YAML document (``common.py``, ``generate.py``, ``openai.py``); cross-document
``$ref``s become imports between them. The flags have a single source: the
``[tool.datamodel-codegen]`` table of the project's ``pyproject.toml``, which
datamodel-code-generator reads itself because it runs with the project root as its working
directory. ``generated/__init__.py`` is hand-written (a re-export) and never touched here.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = PACKAGE_DIR.parent
INPUT_DIR = PACKAGE_DIR / "openapi"
OUTPUT_DIR = PACKAGE_DIR / "generated"
#: Hand-written files in the output folder that codegen must leave alone.
HAND_WRITTEN = frozenset({"__init__.py"})


class CodegenError(RuntimeError):
    """datamodel-code-generator failed, or the project configuration is missing."""


def _check_project_config() -> None:
    pyproject = PROJECT_ROOT / "pyproject.toml"
    if not pyproject.is_file():
        raise CodegenError("pyproject.toml not found next to the gyrfalcon package (run from a source checkout)")
    with pyproject.open("rb") as f:
        if "datamodel-codegen" not in tomllib.load(f).get("tool", {}):
            raise CodegenError("pyproject.toml has no [tool.datamodel-codegen] table")


def expected_modules(input_dir: Path = INPUT_DIR) -> list[str]:
    """The module file names codegen writes: one ``<stem>.py`` per ``*.yaml`` document."""
    return sorted(f"{p.stem}.py" for p in Path(input_dir).glob("*.yaml"))


def render(input_dir: Path = INPUT_DIR) -> dict[str, str]:
    """Run datamodel-code-generator on ``input_dir`` and return ``{module file name: source}``."""
    _check_project_config()
    input_dir = Path(input_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="gyrfalcon-codegen-") as tmp:
        # Only the YAML documents: the openapi package also holds Python modules.
        docs = Path(tmp) / "openapi"
        docs.mkdir()
        for path in input_dir.glob("*.yaml"):
            shutil.copyfile(path, docs / path.name)
        out = Path(tmp) / "generated"
        proc = subprocess.run(
            [sys.executable, "-m", "datamodel_code_generator", "--input", str(docs), "--output", str(out)],
            cwd=PROJECT_ROOT,  # so that it reads [tool.datamodel-codegen] from our pyproject.toml
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise CodegenError(f"datamodel-codegen failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        modules = {}
        for name in expected_modules(input_dir):
            path = out / name
            if not path.is_file():
                raise CodegenError(f"datamodel-codegen wrote no {name}")
            modules[name] = path.read_text()
        return modules


def write(modules: dict[str, str], output_dir: Path = OUTPUT_DIR) -> None:
    """Write the rendered modules into ``output_dir`` (hand-written files are kept)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, text in modules.items():
        (output_dir / name).write_text(text)


def stale_diff(modules: dict[str, str], output_dir: Path = OUTPUT_DIR) -> str:
    """A unified diff from ``output_dir`` to the freshly rendered ``modules``; empty when current.

    Generated-looking modules in ``output_dir`` that no document produces any more count as stale.
    """
    output_dir = Path(output_dir)
    chunks = []
    present = {p.name for p in output_dir.glob("*.py")} - HAND_WRITTEN if output_dir.is_dir() else set()
    for name in sorted(present | set(modules)):
        path = output_dir / name
        old = path.read_text() if path.is_file() else ""
        new = modules.get(name, "")
        if old != new:
            chunks.extend(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    fromfile=f"generated/{name} (committed)",
                    tofile=f"generated/{name} (from openapi/)",
                )
            )
    return "".join(chunks)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 1 stale, 2 error)."""
    parser = argparse.ArgumentParser(prog="python -m gyrfalcon.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 with a diff when stale")
    parser.add_argument("--input-dir", type=Path, default=INPUT_DIR, help="folder of OpenAPI YAML documents")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR, help="folder of generated modules")
    args = parser.parse_args(argv)
    try:
        modules = render(args.input_dir)
    except CodegenError as exc:
        print(f"codegen: {exc}", file=sys.stderr)
        return 2
    if args.check:
        diff = stale_diff(modules, args.output_dir)
        if diff:
            sys.stdout.write(diff)
            print("codegen: generated/ is stale; run `python -m gyrfalcon.codegen`", file=sys.stderr)
            return 1
        return 0
    write(modules, args.output_dir)
    for name in sorted({p.name for p in Path(args.output_dir).glob("*.py")} - HAND_WRITTEN - set(modules)):
        print(f"codegen: {name} has no document any more; delete it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

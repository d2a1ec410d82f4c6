"""The pages of ``docs/`` written from the code, so that they cannot drift from it:
``configuration.md`` from :class:`gyrfalcon.config.Settings` (every ``gyrfalcon serve`` option, its
default and help), ``plugins.md`` from the hook specifications' docstrings (``hookspecs.py``) and
``rules.md`` from the rule registries (``protocol/rules.py``, ``protocol/runtime_rules.py``) and the
documents' ``x-rule`` blocks.

``python -m gyrfalcon.reference`` writes them; ``--check`` writes nothing and exits 1 when a page is
stale (the test suite runs the check, as it runs codegen's).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
GENERATED = "<!-- written by `python -m gyrfalcon.reference` from {source}: edit that, not this page -->"


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == [] or value is argparse.SUPPRESS:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and value >= 10_000:
        return f"`{value:,}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def configuration() -> str:
    """``docs/configuration.md``: the options of ``gyrfalcon serve`` as its parser has them (one per
    :class:`~gyrfalcon.config.Settings` field, and where to listen), grouped as ``--help`` groups them."""
    from gyrfalcon.compose import add_serve_arguments
    from gyrfalcon.config import Settings

    choices = {f.name: f.metadata.get("choices") for f in dataclasses.fields(Settings)}
    parser = argparse.ArgumentParser(prog="gyrfalcon serve")
    add_serve_arguments(parser)
    lines = [GENERATED.format(source="gyrfalcon/config.py"), "", "# Configuration", "",
             "Every option of `gyrfalcon serve` (vLLM's names where vLLM has the option). Pass them after",
             "`--` to `nox -s serve`, e.g. `nox -s serve -- --max-num-seqs 8`. A boolean takes `--x` and",
             "`--no-x`. `gyrfalcon serve --help` prints the same list.", ""]  # fmt: skip
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = "Server and engine" if group.title in ("options", "optional arguments") else group.title
        lines += [f"## {title}", ""]
        if group.description:
            lines += [group.description[0].upper() + group.description[1:] + ".", ""]
        lines += ["| option | default | what it sets |", "|---|---|---|"]
        for action in actions:
            help_text = action.help or ""
            allowed = action.choices or choices.get(action.dest)
            if allowed and not all(str(c) in help_text for c in allowed):
                help_text += f" (one of {', '.join(map(str, allowed))})"
            lines.append(f"| `{action.option_strings[0]}` | {_default(action)} | {_cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


def plugins() -> str:
    """``docs/plugins.md``: how plugins are found, then every hook with its signature and docstring."""
    from gyrfalcon import hookspecs

    lines = [GENERATED.format(source="gyrfalcon/hookspecs.py"), "", "# Plugins", "",
             inspect.cleandoc(hookspecs.__doc__ or ""), "",
             "A plugin package declares itself in its `pyproject.toml`:", "", "```toml",
             f'[project.entry-points.{hookspecs.PROJECT}]', 'my_plugin = "my_package.plugin"', "```", "",
             "`--plugins-allow` and `--plugins-block` choose which installed plugins load.",
             "`examples/gyrfalcon-example-plugin` is a complete third-party package: it declares the request",
             "extension `extensions.suppress_token_ids` and honours it with a batch-shaped logits processor.", "",
             "## Hooks", ""]  # fmt: skip
    hooks = [(name, func) for name, func in vars(hookspecs).items()
             if name.startswith(f"{hookspecs.PROJECT}_") and inspect.isfunction(func)]  # fmt: skip
    for name, func in sorted(hooks, key=lambda hook: hook[1].__code__.co_firstlineno):
        signature = str(inspect.signature(func)).replace("'", "")
        lines += [f"### `{name}`", "", "```python", f"def {name}{signature}", "```", "",
                  inspect.cleandoc(func.__doc__ or ""), ""]  # fmt: skip
    return "\n".join(lines)


def rules() -> str:
    """``docs/rules.md``: the rules a request must meet beyond each field's own type and range."""
    from gyrfalcon.openapi.served import bundle, x_rules
    from gyrfalcon.protocol.rules import stated_rule_ids
    from gyrfalcon.protocol.runtime_rules import RUNTIME_RULES

    stated: dict[str, list[str]] = {}
    for schema, rule_id in x_rules(bundle()):
        if schema not in stated.setdefault(rule_id, []):
            stated[rule_id].append(schema)
    lines = [GENERATED.format(source="gyrfalcon/protocol/rules.py, runtime_rules.py and the documents"), "",
             "# The rules a request must meet", "",
             "Each field's type, range and size are in the OpenAPI documents (and the served spec,",
             "`GET /openapi.json`, with this deployment's limits laid over them). A request must also meet the",
             "rules below; breaking one is a 400 whose `param` names the field.",
             "", "## Between fields, stated in the documents", "",
             "Each is an `if`/`then` block carrying its `x-rule` id in the documents, with the refusal's text",
             "(`description`) and the field it names (`x-param`, else the condition's first field). A client's",
             "validator and Schemathesis read the same blocks the server evaluates (`protocol/rules.py`), in the",
             "documents' order, after each field's own checks.", "",
             "| rule | stated in |", "|---|---|"]  # fmt: skip
    for rule_id in stated_rule_ids():
        lines.append(f"| `{rule_id}` | {', '.join(f'`{s}`' for s in stated.get(rule_id, [])) or '—'} |")
    lines += ["", "## Known only to the running server", "",
              "The served spec lists these under `x-runtime-rules`. `stage` says when each is checked: while the",
              "request is translated, when the engine takes it, while it generates (an error after the first",
              "token), or in the stored responses.", "",
              "| rule | `param` | stage | what it asks |", "|---|---|---|---|"]  # fmt: skip
    for rule in RUNTIME_RULES:
        lines.append(f"| `{rule.id}` | `{rule.param}` | {rule.stage} | {_cell(rule.description)} |")
    lines.append("")
    return "\n".join(lines)


PAGES = {"configuration.md": configuration, "plugins.md": plugins, "rules.md": rules}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyrfalcon.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, render in PAGES.items():
        path = os.path.join(DOCS, name)
        text = render()
        try:
            with open(path, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (run python -m gyrfalcon.reference)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

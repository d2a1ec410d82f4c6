"""The house plan of ``docs/architecture.md``, held against the code's imports.

Rooms are the top-level modules and packages of ``gyrfalcon``; the weight kernels of
``kernels/quant`` and the C kernels of ``kernels/native`` are a leaf room of their own, and the runtime's ``python -m`` entry points
(``__main__`` modules) sit at the top with the command line. An import runs from a room to one listed
before it in :data:`LAYERS`, never to a later one; the engine's side never reaches the wire's rooms;
the server's rooms never import the tooling; no module imports itself back through others; and
modules and functions stay under the plan's sizes.
Imports under ``if TYPE_CHECKING:`` are annotations only and are not counted; imports inside
functions are.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gyrfalcon

PACKAGE = Path(gyrfalcon.__file__).parent

#: the rooms, lowest first: each may import only rooms before it (and the package's face)
LAYERS = [
    "errors", "logtext", "heap", "generated", "kernels", "engine_api", "openapi", "models", "policies", "validation", "engine",
    "structured",
    "client", "tools", "protocol", "hookspecs", "serving", "config", "plugins", "engine_process", "api",
    "compose", "ray", "gunicorn_conf", "engine_main", "cli",
    # tooling: beside the runtime, above it
    "codegen", "reference", "contract", "check", "bench", "campaigns",
]  # fmt: skip
TOOLING = {"codegen", "reference", "contract", "check", "bench", "campaigns"}
#: the engine's side knows token ids, never the wire
ENGINE_SIDE = {"engine", "engine_api", "policies", "validation", "kernels"}
WIRE = {"api", "protocol", "openapi", "serving"}
#: the command line dispatches to the tooling's commands (lazily); no other runtime room may
COMMANDS = {"cli"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # the package's face
    return parts[1]


def _imports(path: Path, typing_too: bool = False) -> set[str]:
    """The gyrfalcon modules ``path`` imports (outside ``if TYPE_CHECKING:`` blocks, unless ``typing_too``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not typing_too and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gyrfalcon"):
            found.add(node.module)
            # ``from gyrfalcon.x import y`` may name the submodule y
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gyrfalcon"))
    return found


def _graph(typing_too: bool = False) -> dict[str, set[str]]:
    sources = {_module(p): p for p in PACKAGE.rglob("*.py") if "generated" not in p.relative_to(PACKAGE).parts}
    return {m: {t for t in _imports(p, typing_too) if t in sources and t != m} for m, p in sources.items()}


def test_every_room_has_a_layer():
    rooms = {_room(m) for m in _graph()} - {None}
    assert rooms - set(LAYERS) == set(), "a new room: give it a place in LAYERS and in docs/architecture.md"


def test_imports_run_down_the_layers_only():
    upward = []
    for module, targets in _graph().items():
        here = _room(module)
        for target in targets:
            there = _room(target)
            if here is None or there is None or there == here:
                continue
            if there in TOOLING and here not in TOOLING and here not in COMMANDS:
                upward.append(f"{module} -> {target} (the runtime imports the tooling)")
            elif here in ENGINE_SIDE and there in WIRE:
                upward.append(f"{module} -> {target} (the engine's side imports the wire's)")
            elif LAYERS.index(there) > LAYERS.index(here) and there not in TOOLING:
                upward.append(f"{module} -> {target} ({here} is below {there})")
    assert upward == []


def test_no_module_imports_itself_back():
    """No circle of imports, counting those made only for type checking (a circle hidden behind
    ``TYPE_CHECKING`` is still two modules that cannot be read one without the other)."""
    graph = _graph(typing_too=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == [], cycles


def test_the_server_never_loads_the_tooling():
    """What ``gyrfalcon serve``'s processes import — the command line parsing ``serve``, gunicorn's
    configuration and worker, the app with its plugins, the engine process — holds no tooling."""
    script = """
import sys
from gyrfalcon import cli
cli.main_parser(["serve"]).parse_args(["serve"])
import gyrfalcon.gunicorn_conf, gyrfalcon.api.app, gyrfalcon.api.worker
import gyrfalcon.engine_main, gyrfalcon.engine_process.launch
from gyrfalcon.plugins import merged_dict, plugin_manager
pm = plugin_manager()
merged_dict(pm.hook.gyrfalcon_engines(), "engine")
tooling = set(sys.argv[1:])
print(" ".join(sorted(m for m in sys.modules if m.startswith("gyrfalcon.") and m.split(".")[1] in tooling)))
"""
    done = subprocess.run([sys.executable, "-c", script, *TOOLING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == []


def test_an_api_worker_holds_no_torch(tiny_model_dir):
    """What an API worker runs — the app, the engine client over a remote core, the tokenizer and
    its chat template — never imports torch (about 230 MiB a worker): the engine process does."""
    script = """
import sys
import gyrfalcon.api.app, gyrfalcon.api.worker, gyrfalcon.engine_process.remote, gyrfalcon.client
from gyrfalcon.models.loading import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
tokenizer.decode(tokenizer("hello")["input_ids"])
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    done = subprocess.run([sys.executable, "-c", script, tiny_model_dir], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_modules_and_functions_stay_small():
    """The house plan's sizes: no module over 400 lines, no function over 60, outside ``generated/``."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "generated" in path.relative_to(PACKAGE).parts:
            continue
        source = path.read_text()
        if len(source.splitlines()) > 400:
            too_long.append(f"{_module(path)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{_module(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


def test_the_engine_policies_read_their_bounds_without_the_documents():
    """The built-in policies read each field's bounds from the table codegen wrote, so the engine
    process never reads the OpenAPI documents (YAML) for them."""
    script = """
from gyrfalcon.openapi import served
from gyrfalcon.engine_api.limits import field_keywords, field_range
import gyrfalcon.policies.sampling, gyrfalcon.policies.penalties, gyrfalcon.policies.logprobs
assert field_range("temperature").refusal(-1.0) and field_keywords("logprob_token_ids")["maxItems"] == 128
assert served._bundle_json.cache_info().misses == 0, "the documents were read"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

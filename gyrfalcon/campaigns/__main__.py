"""``python -m gyrfalcon.campaigns {slow-clients,sigterm,soak,fuzz,abuse} [--model M | --url URL] [sizes]``.

Without ``--url`` a server is started (``gyrfalcon serve`` on a free port, the embedded default
model unless ``--model``) and stopped at the end; ``sigterm`` always starts its own. The exit
status is 0 when every target was met.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from gyrfalcon.bench.server import launch, serve_argv


def _server(args: argparse.Namespace, extra: str = ""):
    log = tempfile.NamedTemporaryFile(prefix=f"gyrfalcon-{args.campaign}-", suffix=".log", delete=False).name
    argv = lambda port: serve_argv(port, args.model, "cpu", "auto", args.num_threads, args.max_num_seqs,  # noqa: E731
                                   f"{extra} {args.serve_args}")  # fmt: skip
    print(f"campaign {args.campaign}: starting a server (log: {log})", flush=True)
    return launch(argv, log)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gyrfalcon.campaigns", description=__doc__)
    p.add_argument("campaign", choices=("slow-clients", "sigterm", "soak", "fuzz", "abuse"))
    p.add_argument("--url", default=None, help="a running server (not for sigterm)")
    p.add_argument("--model", default=None, help="model for the server started here (default: embedded)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--serve-args", default="", help="more `gyrfalcon serve` options, one string")
    p.add_argument("--idle", type=int, default=500, help="slow-clients: idle connections")
    p.add_argument("--one-byte", type=int, default=500, help="slow-clients: connections that sent one byte")
    p.add_argument("--non-reading", type=int, default=100, help="slow-clients: streams nobody reads")
    p.add_argument("--requests", type=int, default=None, help="soak: 2000; sigterm: 48")
    p.add_argument("--concurrency", type=int, default=8, help="soak")
    p.add_argument("--drain-timeout", type=float, default=5.0, help="sigterm: the server's --drain-timeout")
    p.add_argument("--max-examples", type=int, default=1000, help="fuzz: examples per operation")
    p.add_argument("--schemas", type=int, default=100, help="abuse: distinct tool schemas sent")
    p.add_argument("--schema-bytes", type=int, default=1 << 20, help="abuse: each schema's size")
    p.add_argument("--max-tokens", type=int, default=16, help="fuzz: valid cases ask for at most this many new tokens (0: as generated)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.campaign == "sigterm":
        from gyrfalcon.campaigns import sigterm

        server = _server(args, f"--drain-timeout {args.drain_timeout}")
        try:
            report = sigterm.run(server, args.requests or 48)
        finally:
            server.stop()
    elif args.campaign == "abuse":
        from gyrfalcon.campaigns import abuse

        server = None if args.url else _server(args)  # the defaults: what a deployment gets
        try:
            report = abuse.run(args.url or server.url, None if server is None else server.proc.pid, args.schemas, args.schema_bytes)
        finally:
            if server is not None:
                server.stop()
    else:
        # slow clients: they must stay open while measured (the header timeout is what ends them)
        extra = "--max-queue-len 2048" + (" --client-header-timeout 300" if args.campaign == "slow-clients" else "")
        server = None if args.url else _server(args, extra)
        url = args.url or server.url
        try:
            if args.campaign == "slow-clients":
                from gyrfalcon.campaigns import slow_clients

                report = slow_clients.run(url, args.idle, args.one_byte, args.non_reading)
            elif args.campaign == "fuzz":
                from gyrfalcon.campaigns import fuzz

                report = fuzz.run(url, args.max_examples, max_tokens=args.max_tokens)
            else:
                from gyrfalcon.campaigns import soak

                report = soak.run(url, args.requests or 2000, args.concurrency)
        finally:
            if server is not None:
                server.stop()
    print(f"campaign {args.campaign}:")
    for line in report.lines():
        print("  " + line)
    return 0 if report.met() else 1


if __name__ == "__main__":
    sys.exit(main())

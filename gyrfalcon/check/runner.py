"""Run checks against a target and keep what each concluded."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Callable, Iterable

from gyrfalcon.check.registry import Broken, Check, Inconclusive, Outcome, Result, Unsupported
from gyrfalcon.check.target import Target


def run_check(target: Target, one: Check) -> Result:
    """One check, concluded: an exception of the check's own making is the server's doing (broken);
    an unreachable server is an error of the run."""
    target.replies.clear()
    started = time.monotonic()
    try:
        one.run(target)
        outcome, message = Outcome.PASSED, ""
    except Unsupported as exc:
        outcome, message = Outcome.UNSUPPORTED, str(exc)
    except Inconclusive as exc:
        outcome, message = Outcome.INCONCLUSIVE, str(exc)
    except Broken as exc:
        outcome, message = Outcome.FAILED, str(exc)
    except TimeoutError:
        outcome, message = Outcome.FAILED, f"no answer within {target.timeout:.0f} s"
    except (ConnectionRefusedError, socket.gaierror, ssl.SSLError) as exc:  # never reached the server
        outcome, message = Outcome.ERROR, f"{type(exc).__name__}: {exc}"
    except (OSError, http.client.HTTPException) as exc:  # reached it, and it hung up instead of answering
        outcome, message = Outcome.FAILED, f"the server closed the connection without a whole answer ({type(exc).__name__}: {exc})"
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        # a reply missing what the contract says it holds
        outcome, message = Outcome.FAILED, f"a reply without what the contract says it holds ({type(exc).__name__}: {exc})"
    reproduce = target.replies[-1].curl if target.replies and outcome is Outcome.FAILED else ""
    return Result(one, outcome, message, reproduce, time.monotonic() - started)


def run_checks(target: Target, checks: Iterable[Check], progress: Callable[[Result], None] | None = None) -> list[Result]:
    results = []
    for one in checks:
        result = run_check(target, one)
        results.append(result)
        if progress:
            progress(result)
    return results

"""gyrfalcon on Ray Serve: engine replicas behind one endpoint (``pip install 'gyrfalcon[ray]'``).

- :mod:`.app`: the application (an ingress deployment serving the Falcon ASGI app, the engine
  deployment) and ``gyrfalcon serve --ray``;
- :mod:`.replica`: one engine core per replica, reached through deployment handles;
- :mod:`.core`: the ingress's ``EngineCore`` over those handles (streaming, abort by cancel);
- :mod:`.router`: prefix-affinity routing (Ray Serve's request-router hook).

``serve run gyrfalcon.ray:app [model=PATH replicas=2 …]`` runs it on Ray Serve's own command line:
:func:`app` is an application builder whose arguments are ``gyrfalcon serve``'s options.
Nothing here imports Ray until it is used, so the rest of gyrfalcon runs without it.
"""

from __future__ import annotations

from typing import Any


def app(args: dict[str, str] | None = None) -> Any:
    """Ray Serve's application builder: ``args`` are ``gyrfalcon serve`` options (``model``,
    ``replicas``, ``max_replicas``, ``routing``, …)."""
    from gyrfalcon.ray.app import application, settings_from_options

    settings, keys_file = settings_from_options(dict(args or {}))
    return application(settings, keys_file)

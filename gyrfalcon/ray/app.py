"""The Ray Serve application: an ingress deployment serving the Falcon ASGI app, engine replicas
behind it.

- ``ingress`` (``--api-workers`` replicas): the API of :func:`gyrfalcon.api.app.create_app` —
  tokenizer, chat template, detokenizer, stop strings — over a
  :class:`gyrfalcon.ray.core.RayEngineCore`;
- ``engine`` (``--replicas``, or autoscaled up to ``--max-replicas`` by ongoing requests): one
  :class:`gyrfalcon.ray.replica.EngineReplica` each, with ``--replica-cpus`` CPUs and one GPU where
  the cluster has GPUs; requests are routed by :class:`gyrfalcon.ray.router.PrefixAffinityRouter`
  (``--routing prefix``) or Ray Serve's power of two choices (``--routing pow2``);
- ``served-state`` (one replica, no CPU): the control calls' record, which engine replicas started
  later take over (:mod:`gyrfalcon.ray.state`).

Started by ``gyrfalcon serve --ray`` (:func:`serve_forever`) or ``serve run gyrfalcon.ray:app
[key=value …]`` (:func:`gyrfalcon.ray.app`; keys are ``gyrfalcon serve``'s options).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from typing import Any

from gyrfalcon.config import Settings, read_private_keys_file, write_private_keys_file

log = logging.getLogger(__name__)

#: the name of the application on Ray Serve
APP_NAME = "gyrfalcon"
#: environment of every replica (no model hub: the model is on disk)
REPLICA_ENV = {"HF_HUB_OFFLINE": "1", "MALLOC_ARENA_MAX": "2", "TOKENIZERS_PARALLELISM": "false"}


class Ingress:
    """The API on one ingress replica (its ASGI app is built on the replica, see
    ``__serve_build_asgi_app__``)."""

    def __init__(self, engine: Any, settings_json: str, api_keys_file: str | None = None, state: Any = None) -> None:
        self._engine_handle, self._state = engine, state
        self._settings = Settings(**json.loads(settings_json))
        if api_keys_file:
            self._settings.api_keys = read_private_keys_file(api_keys_file)

    def __serve_build_asgi_app__(self) -> Any:
        from gyrfalcon import compose
        from gyrfalcon.client import EngineClient
        from gyrfalcon.ray.core import RayEngineCore

        settings = self._settings
        engine = EngineClient(RayEngineCore(self._engine_handle, self._state), model_name=settings.served_names()[0])
        return compose.app(settings, engine, compose.plugins(settings))


def replica_gpus(settings: Settings) -> float:
    """GPUs per engine replica: the setting, else one where the Ray cluster has GPUs."""
    if settings.replica_gpus is not None:
        return settings.replica_gpus
    import ray

    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def engine_options(settings: Settings) -> dict[str, Any]:
    """The engine deployment's Ray Serve options, from the settings."""
    from ray.serve.config import RequestRouterConfig

    gpus = replica_gpus(settings)
    if settings.device.startswith("cuda") and gpus < 1:
        raise ValueError("--device cuda needs a GPU per engine replica (--replica-gpus 1)")
    options: dict[str, Any] = {
        "name": "engine",
        # a replica holds its running batch and as many waiting; past that Ray's queue holds the rest
        "max_ongoing_requests": 2 * settings.max_num_seqs,
        "max_queued_requests": settings.max_queue_len,
        "ray_actor_options": {"num_cpus": settings.replica_cpus, "num_gpus": gpus,
                              "runtime_env": {"env_vars": REPLICA_ENV}},  # fmt: skip
        "graceful_shutdown_timeout_s": settings.drain_timeout,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
    }
    if settings.max_replicas is None:
        options["num_replicas"] = settings.replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": settings.replicas,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.target_ongoing_requests,
            "upscale_delay_s": settings.upscale_delay_s,
            "downscale_delay_s": settings.downscale_delay_s,
            "metrics_interval_s": 1.0,
            "look_back_period_s": 5.0,
        }
    if settings.routing == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="gyrfalcon.ray.router:PrefixAffinityRouter",
            request_router_kwargs={"block_size": settings.block_size},
        )
    return options


def application(settings: Settings, api_keys_file: str | None = None) -> Any:
    """The bound Ray Serve application for ``settings`` (``api_keys_file``: a private file of the
    keys, read by the ingress replicas; keys never travel in Ray's deployment arguments)."""
    from ray import serve

    from gyrfalcon.ray.replica import EngineReplica
    from gyrfalcon.ray.state import ServedState

    public = settings.to_env()  # without the API keys
    state = serve.deployment(ServedState, name="served-state", num_replicas=1, ray_actor_options={"num_cpus": 0}).bind(public)
    engine = serve.deployment(EngineReplica, **engine_options(settings)).bind(public, state)
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="ingress",
        num_replicas=settings.api_workers,
        max_ongoing_requests=settings.max_queue_len,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
        graceful_shutdown_timeout_s=settings.drain_timeout,
    )
    return ingress.bind(engine, public, api_keys_file, state)


def settings_from_options(options: dict[str, str]) -> tuple[Settings, str | None]:
    """``serve run gyrfalcon.ray:app key=value …``: each key is a ``gyrfalcon serve`` option (``-``
    or ``_``); the keys of ``$GYRFALCON_API_KEY`` and ``api_key_file`` go to a private file."""
    import argparse

    from gyrfalcon import compose
    from gyrfalcon.models.default import resolve_model

    parser = argparse.ArgumentParser(prog="serve run gyrfalcon.ray:app")
    compose.add_serve_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    argv = []
    for key, value in options.items():
        name = key.replace("-", "_")
        action = actions.get(name)
        flag = action.option_strings[0] if action else "--" + name.replace("_", "-")
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            yes = str(value).lower() in ("1", "true", "yes")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if yes else "--no-" + flag[2:])
            elif yes:
                argv.append(flag)
        else:
            argv += [flag, *str(value).split()]
    args = parser.parse_args(argv)
    args.ray = True
    settings = compose.serve_settings(args)
    settings.model = resolve_model(settings.model, settings.cache_dir)
    keys_file = write_private_keys_file(settings.api_keys) if settings.api_keys else None
    return settings, keys_file


def serve_forever(settings: Settings, host: str, port: int) -> int:
    """``gyrfalcon serve --ray``: start (or join ``$RAY_ADDRESS``'s) Ray, run the application with
    Ray Serve's proxy on ``host:port``, and stop it on SIGTERM or SIGINT (Ray Serve drains the
    replicas for up to ``--drain-timeout``)."""
    import ray
    from ray import serve

    keys_file = write_private_keys_file(settings.api_keys) if settings.api_keys else None
    stop = threading.Event()
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": REPLICA_ENV})  # fmt: skip
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets handlers of its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        http: dict[str, Any] = {"host": host, "port": port}
        if settings.ssl_certfile:
            http.update(ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile)
        serve.start(http_options=http)
        serve.run(application(settings, keys_file), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("gyrfalcon on Ray Serve: ready on %s:%d", host, port)
        print(f"gyrfalcon: ready on Ray Serve at {host}:{port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
        if keys_file:
            os.unlink(keys_file)
    return 0

"""The engine in its own process, reached by the API workers over ZeroMQ with msgpack.

- :mod:`.server` runs in the engine process (``python -m gyrfalcon.engine_main ADDRESS``): it
  owns the model and the device, deals in token ids only, and serves every API worker through one
  ROUTER socket;
- :mod:`.remote` is the API worker's side: :class:`RemoteEngineCore`, an
  :class:`~gyrfalcon.engine_api.interface.EngineCore` whose calls and streams cross that socket (the
  worker's :class:`~gyrfalcon.client.EngineClient` does the text work around it);
- :mod:`.launch` is what ``gyrfalcon serve`` runs: the engine process, then gunicorn's master, and
  their shutdown in order;
- :mod:`~gyrfalcon.engine_api.codec` packs the engine boundary's types (beside them: Ray's
  replicas use it too); it is importable from here as before.

The wire: multipart messages ``[kind, payload]`` (the ROUTER prepends the worker's identity), the
payload a msgpack value. Worker → engine: ``hello``, ``submit [call_id, request]``, ``abort
[request_id]``, ``finish [request_id, index, stop_reason]``, ``call [call_id, name, args]``
(``stats``), ``ping``, ``bye``. Engine → worker: ``info [info, health, pid]``, ``reply [call_id,
refusal_or_value]``, ``out [[request_id, output_or_None], …]`` (one message per worker per flush;
None ends a stream), ``beat [health]``. A request's id in the engine is ``<worker identity>:<id>``.
"""

from gyrfalcon.engine_api import codec  # noqa: F401 - the codec's former home

#: the environment variable through which ``gyrfalcon serve`` tells API workers where the engine is
ENGINE_ADDRESS_ENV = "GYRFALCON_ENGINE_ADDRESS"

#: seconds between heartbeats, both ways
BEAT_S = 0.5
#: seconds of silence after which the other side is taken for dead (a worker: its requests are
#: aborted; the engine: every waiting client gets a 503 and /health turns 503)
SILENCE_S = 3.0

"""The engine client: everything text on the API side of the engine's boundary (vLLM v1's output
processor). It tokenizes and renders chat templates for the frontend, turns the engine core's
token ids into text (incremental detokenisation, stop strings, output-kind aggregation) in the
consumer's thread, and tells the core to stop a choice whose text hit a stop string. The core deals
in token ids only: in this process (``--no-engine-process``), in the engine process behind
:class:`gyrfalcon.engine_process.remote.RemoteEngineCore`, or in Ray replicas."""

from gyrfalcon.client.engine_client import ClientStream, EngineClient

__all__ = ["ClientStream", "EngineClient"]

"""The engine's boundary, free of torch: the plain-data requests and outputs, the ``Engine``
protocol, output streams and typed errors. ``protocol/``, ``serving/``, ``plugins/`` and the API
import this package, never ``gyrfalcon.engine``, so the engine may run in another process."""

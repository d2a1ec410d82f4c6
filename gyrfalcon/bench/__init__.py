"""``gyrfalcon bench``: a load generator for OpenAI-compatible servers and the bare-loop ceiling.

- :mod:`gyrfalcon.bench.client`: fixed-concurrency streaming load (TTFT, time per output token);
- :mod:`gyrfalcon.bench.ceiling`: the bare torch loop the engine is measured against;
- :mod:`gyrfalcon.bench.run`: the command (load levels, n vs sequential, memory check, table).
"""

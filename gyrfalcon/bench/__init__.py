"""``gyrfalcon bench``: a load generator for OpenAI-compatible servers and the ceilings it is measured against.

- :mod:`gyrfalcon.bench.client`: fixed-concurrency streaming load (TTFT, time per output token);
- :mod:`gyrfalcon.bench.ceiling`: the eager loop and the compiled static-cache loop on the same model;
- :mod:`gyrfalcon.bench.weights`: a model of a real shape with random weights, where weights cannot be fetched;
- :mod:`gyrfalcon.bench.server`: ``gyrfalcon serve`` launched for a run;
- :mod:`gyrfalcon.bench.memory`: the worker's RSS before and after many mixed requests;
- :mod:`gyrfalcon.bench.report`: the table, the device's target ratios and the JSON figures;
- :mod:`gyrfalcon.bench.run`: the command (load levels, n vs sequential, memory check, ceilings, report).
"""

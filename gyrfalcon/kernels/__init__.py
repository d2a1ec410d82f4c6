"""The kernels: the weight-only quantised layers (``quant/``: layouts, the int4/int8 layer classes,
``--quantization``) and the C kernels built at first use for the machine's instruction set
(``native/``; ``native/cpu.py`` is the one place that says what the CPU is). A room of its own:
it imports nothing of the engine, and both ``models/`` (loading) and ``engine/`` (the runner) use it.
docs/kernels.md says what runs on which instruction set, and why."""

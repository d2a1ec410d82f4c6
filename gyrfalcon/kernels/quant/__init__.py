"""Weight-only quantisation: neutral weight layouts, torch-kernel layers, and ``--quantization``.

Importing this package loads no torch: :data:`QUANTIZATIONS` is read by the server's settings
(whose process never imports torch); the rest lives in :mod:`.weights`, :mod:`.layers` and :mod:`.apply`.
"""

QUANTIZATIONS = ("auto", "none", "int4", "int8")

__all__ = ["QUANTIZATIONS"]

"""The compiled decode step's verdicts, kept between starts.

A batch bucket whose compiled step failed — its compile raised, or it gave other bits than the
eager step — fails the same way at every start on the same machine, versions and model: on an
AVX2 machine three buckets were compiled for about 90 s each at every start only to be dropped.
Such a verdict is written beside inductor's cache, under a key of everything that decides it (the
versions of torch, transformers and gyrfalcon, the sources of the step's code and kernels, the CPU
and its instruction set, the model's structure and config, the cache's dtype and the bucket
widths); a later start with the same key does not compile that bucket. A step found slower than the
eager one is not kept: a timing depends on the machine's load at the moment.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_ENGINE = Path(__file__).resolve().parents[1]


def _sources_digest() -> str:
    """A digest of the engine's step code and kernels (any change may change a verdict)."""
    digest = hashlib.sha256()
    for path in sorted([*_ENGINE.rglob("*.py"), *_ENGINE.rglob("*.c")]):
        digest.update(path.relative_to(_ENGINE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def verdict_key(model: torch.nn.Module, *facts: object) -> str:
    """The key a verdict is kept under: versions, sources, CPU, ``model`` (its modules and config)
    and ``facts`` (the cache's dtype, the bucket widths: whatever else shapes the step)."""
    import transformers

    import gyrfalcon
    from gyrfalcon.kernels.native.cpu import cpu

    here = cpu()
    config = getattr(model, "config", None)
    parts = [torch.__version__, transformers.__version__, gyrfalcon.__version__, _sources_digest(), here.model, here.isa,
             " ".join(sorted(here.flags)), repr(model), config.to_json_string() if config is not None else "",
             *map(str, facts)]  # fmt: skip
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


class Verdicts:
    """The batch buckets refused at earlier starts, and why, in ``folder/compiled-verdicts-<key>.json``
    (``folder`` None: nothing is kept)."""

    def __init__(self, folder: Path | None, key: str) -> None:
        self.path = None if folder is None else Path(folder) / f"compiled-verdicts-{key}.json"
        self._refused: dict[str, str] = {}
        if self.path is not None and self.path.is_file():
            try:
                self._refused = {str(k): str(v) for k, v in json.loads(self.path.read_text(encoding="utf-8")).items()}
            except (OSError, ValueError, AttributeError):
                self._refused = {}

    def refused(self, batch: int) -> str | None:
        """Why ``batch``'s compiled step was refused at an earlier start (None: it was not)."""
        reason = self._refused.get(str(batch))
        return None if reason is None else f"{reason} (at an earlier start; kept in {self.path}: delete it to compile again)"

    def record(self, batch: int, reason: str) -> None:
        """Keep ``batch``'s refusal for later starts (written atomically; a folder that cannot be
        written keeps nothing, and the log says so)."""
        self._refused[str(batch)] = reason
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=self.path.parent, suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._refused, f, indent=1, sort_keys=True)
            os.replace(partial, self.path)
        except OSError as error:
            log.warning("the compiled step's verdict for batch %d is not kept: %s", batch, error)

"""A Lightning ``CheckpointIO`` that writes a local checkpoint straight to disk, without a copy in memory.

Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into an ``io.BytesIO`` before writing it
(``lightning.fabric.utilities.cloud_io._atomic_save``), so every save holds a second copy of the weights and
the optimizer state for a moment: with the demo's float32 policy and AdamW (~1.6 GB) the step-8 save rose
from 5.6 to 7.1 GB, the peak of its 16 steps (training peaked at 6.1; docs/benchmarks.md "Memory").
:class:`StreamingCheckpointIO` lets ``torch.save`` stream to a temporary file beside the target, flushed to
disk and renamed over it: a crash mid-save leaves the previous checkpoint whole, as Lightning's write does.
Paths on other filesystems (fsspec URLs) and ``storage_options`` keep Lightning's way.

.. code-block:: yaml

    trainer:
      plugins:
        - class_path: tlt_lightning.efficiency.StreamingCheckpointIO
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["StreamingCheckpointIO"]


class StreamingCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves stream to a temporary file renamed over the target."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        protocol = get_filesystem(path).protocol  # fsspec's: "file" (or ("file", "local")) on this machine
        local = "file" in ((protocol,) if isinstance(protocol, str) else protocol)
        if storage_options is not None or not local:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

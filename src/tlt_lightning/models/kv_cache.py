"""A preallocated, per-row KV cache that plugs into transformers attention layers.

Each batch row (a request) has its own committed length, so rows of different lengths share one
buffer without padding tricks: new keys are written at ``lengths[row] + offset`` and attention is
restricted by an explicit 4D mask built by the caller. Finished requests leave the batch by moving
the last active row into their slot (:meth:`KVCache.move_rows`), which keeps the active rows a
prefix ``[0, n)`` of the buffer, so attention runs on a view, never on a gathered copy.

Rolling back rejected speculative tokens is a change of ``lengths`` only; tree drafting compacts
accepted nodes into place with :meth:`KVCache.gather_positions`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of every layer for up to ``max_batch`` sequences of up to ``max_len`` tokens.

    Transformers' attention layers call :meth:`update` with the new keys/values of the current
    forward; the positions they are written at are set beforehand with :meth:`begin_step`.

    Args:
        num_layers: decoder layers of the model.
        max_batch: rows (requests) the buffer holds.
        num_kv_heads: key/value heads per layer.
        max_len: tokens per row (prompt + generated + speculative scratch space).
        head_dim: size of one head.
        dtype: storage dtype (the model's).
        device: storage device.
        spare_slots: storage slots per row beyond ``max_len``, never part of a sequence (bucketed
            compiled forwards write the keys of their padding there, see
            :mod:`~tlt_lightning.models.compiled`).

    Attributes:
        keys, values: ``[L, B, H_kv, S, D]`` buffers, ``S = max_len + spare_slots``.
        lengths: ``[B]`` int64, committed tokens per row.
    """

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        spare_slots: int = 0,
    ) -> None:
        shape = (num_layers, max_batch, num_kv_heads, max_len + spare_slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self._rows = 0
        self._write_pos: torch.Tensor | None = None  # [n, q] positions of the current step
        self._kv_len = 0

    @property
    def max_batch(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def begin_step(self, rows: int, positions: torch.Tensor) -> int:
        """Declare where the next forward writes: rows ``[0, rows)`` at ``positions``.

        Args:
            rows: active rows ``n`` (a prefix of the buffer).
            positions: ``[n, q]`` int64 cache slots of the new tokens of each row.

        Returns:
            The key length ``kv_len`` that attention will see (``max(positions) + 1``); the
            caller's mask must be ``[n, 1, q, kv_len]``.
        """
        if positions.shape[0] != rows:
            raise ValueError(f"positions has {positions.shape[0]} rows, expected {rows}")
        kv_len = int(positions.max()) + 1
        if kv_len > self.max_len:
            raise ValueError(f"KV cache overflow: position {kv_len - 1} >= max_len {self.max_len}")
        self._rows, self._write_pos, self._kv_len = rows, positions, kv_len
        return kv_len

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[n, H, q, D]`` new keys/values, return ``[n, H, kv_len, D]`` views of the cache."""
        assert self._write_pos is not None, "begin_step() must precede the forward pass"
        n = self._rows
        rows = torch.arange(n, device=self.keys.device)[:, None]
        # Advanced indices on dims 0 and 2 come first in the indexed shape: [n, q, H, D].
        self.keys[layer_idx][rows, :, self._write_pos] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[layer_idx][rows, :, self._write_pos] = value_states.transpose(1, 2).to(self.values.dtype)
        return self.keys[layer_idx, :n, :, : self._kv_len], self.values[layer_idx, :n, :, : self._kv_len]

    def view(self, start: int, stop: int) -> KVCache:
        """Rows ``[start, stop)`` as a cache of their own that shares this one's storage (for chunked
        prefill)."""
        view = object.__new__(KVCache)
        view.keys, view.values = self.keys[:, start:stop], self.values[:, start:stop]
        view.lengths, view.max_len = self.lengths[start:stop], self.max_len
        view._rows, view._write_pos, view._kv_len = 0, None, 0
        return view

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows ``src`` onto rows ``dst`` (``[m]`` int64 each; the sets must not overlap)."""
        if src.numel() == 0:
            return
        used = int(self.lengths[src].max())
        self.keys[:, dst, :, :used] = self.keys[:, src, :, :used]
        self.values[:, dst, :, :used] = self.values[:, src, :, :used]
        self.lengths[dst] = self.lengths[src]

    def gather_rows(self, source: torch.Tensor) -> None:
        """Rows ``[0, m)`` become copies of rows ``source`` (``[m]`` int64; repeats allowed, e.g. one
        prefilled prompt fanned out to the rows of its GRPO group). All of ``source`` is read before any
        row is written."""
        m, used = source.numel(), int(self.lengths[source].max())
        self.keys[:, :m, :, :used] = self.keys[:, source, :, :used]
        self.values[:, :m, :, :used] = self.values[:, source, :, :used]
        self.lengths[:m] = self.lengths[source]

    def gather_positions(self, rows: torch.Tensor, src: torch.Tensor, dst_start: torch.Tensor) -> None:
        """Within each row, copy the entries at ``src`` to consecutive slots from ``dst_start``.

        Args:
            rows: ``[m]`` rows to touch.
            src: ``[m, k]`` source slots per row (ascending, each ``>= dst_start``, so no entry is
                overwritten before it is read).
            dst_start: ``[m]`` first destination slot per row.
        """
        if rows.numel() == 0 or src.shape[1] == 0:
            return
        dst = dst_start[:, None] + torch.arange(src.shape[1], device=src.device)
        r = rows[:, None]
        # Indexing makes a copy of the sources first, so overlapping ranges are safe.
        self.keys[:, r, :, dst] = self.keys[:, r, :, src]
        self.values[:, r, :, dst] = self.values[:, r, :, src]

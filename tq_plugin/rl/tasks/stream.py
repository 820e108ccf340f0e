"""The run's prompt stream over a dataset's rows: a seeded shuffle per epoch, one epoch after the
other. A cursor walks it (and rides the checkpoint); a disaggregated worker seeks the slot its
ticket names, so a slot's rows are the same whoever draws them and however often."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tq_plugin.config import ConfigError


class PromptStream:
    """Row numbers ``0 .. rows - 1`` in a seeded shuffle (``shuffle``), epoch after epoch."""

    def __init__(self, rows: int, *, seed: int, shuffle: bool = True, key: str = "task.path"):
        if rows < 1:
            raise ConfigError(f"{key}: the dataset holds no rows")
        self.rows, self.seed, self.shuffle, self.key = rows, seed, shuffle, key
        self.epoch, self.cursor = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.rows))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.rows, generator=g).tolist()

    def next_rows(self, n: int) -> list[int]:
        """The next ``n`` row numbers of the stream."""
        out: list[int] = []
        while len(out) < n:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._epoch_order()
            take = min(n - len(out), len(self._order) - self.cursor)
            out += self._order[self.cursor:self.cursor + take]
            self.cursor += take
        return out

    def seek(self, position: int) -> None:
        """Put the cursor at ``position`` of the stream."""
        if position < 0:
            raise ValueError(f"seek: position must be >= 0, got {position}")
        epoch, cursor = divmod(position, self.rows)
        if epoch != self.epoch:
            self.epoch = epoch
            self._order = self._epoch_order()
        self.cursor = cursor

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "rows": self.rows}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["rows"] != self.rows:
            raise ConfigError(f"{self.key}: the checkpoint's dataset had {state['rows']} rows, "
                              f"this one has {self.rows}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order()


__all__ = ["PromptStream"]

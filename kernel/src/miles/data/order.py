"""``EpochOrder``: which record comes next. Deterministic, resumable, reshuffled every epoch.

The order of epoch ``e`` is a permutation drawn from ``random.Random(f"miles-data:{seed}:{e}")``
(string seeds hash the same in every process and Python version since 3.2), so it depends only on
the seed, the epoch and the number of records: a resumed run sees exactly the order it would have
seen, and the state to save is two integers.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from miles.data.errors import DataError


class EpochOrder:
    def __init__(self, size: int, *, seed: int, shuffle: bool) -> None:
        if size <= 0:
            raise ValueError("EpochOrder needs at least one record")
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # next index into this epoch's permutation
        self._permutation: list[int] | None = None

    def take(self, n: int) -> list[tuple[int, int]]:
        """The next ``n`` records as ``(record index, epoch)``, crossing epochs as needed."""
        taken: list[tuple[int, int]] = []
        while len(taken) < n:
            if self.position == self.size:
                self.epoch += 1
                self.position = 0
                self._permutation = None
            permutation = self._current()
            stop = min(self.size, self.position + n - len(taken))
            taken += [(permutation[i], self.epoch) for i in range(self.position, stop)]
            self.position = stop
        return taken

    def _current(self) -> list[int]:
        if self._permutation is None:
            self._permutation = list(range(self.size))
            if self.shuffle:
                random.Random(f"miles-data:{self.seed}:{self.epoch}").shuffle(self._permutation)
        return self._permutation

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": self.size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = (state.get("size"), state.get("seed"), state.get("shuffle"))
        if saved != (self.size, self.seed, self.shuffle):
            raise DataError(
                f"the saved data position is for {saved[0]} records with seed {saved[1]} and shuffle {saved[2]}, but the data "
                f"now has {self.size} records with seed {self.seed} and shuffle {self.shuffle}; resuming would not continue "
                f"the same order. Restore the original data and data.seed / data.shuffle, or start a new run"
            )
        if not 0 <= int(state["position"]) <= self.size or int(state["epoch"]) < 0:
            raise DataError(f"invalid saved data position: epoch {state['epoch']}, position {state['position']} of {self.size}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._permutation = None

"""A seeded, shuffling batch loader whose data position can be saved and restored exactly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


class ResumableLoader:
    """Batches of ``dataset`` items in a per-epoch permutation fixed by ``(seed, epoch)``.

    ``iter(loader)`` yields the rest of the current epoch and then moves the position to the start
    of the next one, so ``for epoch in ...: for batch in loader:`` works and so does resuming in the
    middle of an epoch. ``state_dict()`` taken after receiving a batch names the *next* batch:
    ``load_state_dict`` on a fresh loader over the same data continues with exactly that batch.
    ``collate(items, epoch, rows)`` receives the items and their dataset indices.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        collate: Callable[[list, int, list[int]], Any],
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = len(dataset)
        if n == 0:
            raise ValueError("the dataset is empty")
        if drop_last and n < batch_size:
            raise ValueError(f"the dataset has {n} rows, fewer than one batch of {batch_size} (drop_last)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> Iterator[Any]:
        order = self.order(self.epoch)
        while self.index < len(self):
            rows = order[self.index * self.batch_size : (self.index + 1) * self.batch_size].tolist()
            epoch = self.epoch
            self.index += 1  # before yielding: a state_dict taken now points at the next batch
            yield self.collate([self.dataset[i] for i in rows], epoch, rows)
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "num_rows": len(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "shuffle", "num_rows"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot resume the data position exactly: saved {key}={state[key]!r}, this loader has {mine!r}"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self):
            raise ValueError(
                f"invalid data position epoch={epoch} index={index} ({len(self)} batches per epoch)"
            )
        self.epoch, self.index = epoch, index

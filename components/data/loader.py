"""A deterministic, resumable batch loader with optional length bucketing and rank sharding.

The batch order of an epoch is a pure function of (seed, epoch, rank, world_size, dataset lengths), and the
loader's state is just (epoch, batches consumed), so a run resumed from `state_dict()` sees exactly the batches
the interrupted run would have seen. Written here rather than torch's DataLoader + DistributedSampler because
mid-epoch resume needs the position inside the epoch, which those do not keep (torchdata's StatefulDataLoader
would, but snapshots worker/iterator internals that are tied to its version).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import RecipeError


def _item_len(item: dict) -> int:
    return len(item["tokens"])


class StatefulLoader:
    """Iterate one epoch per `for` loop; `state_dict()`/`load_state_dict()` save and restore the position.

    Sharding: the epoch's permutation is padded by wrap-around to a multiple of world_size and rank r takes
    positions r, r+world_size, ... so every rank has the same number of batches (collectives never hang).
    Bucketing: within windows of `batch_size * bucket_window` shuffled examples, examples are sorted by
    length and cut into batches, then batch order is shuffled; less padding, same determinism.
    """

    def __init__(self, dataset: Sequence[dict], batch_size: int, shuffle: bool = True, seed: int = 0,
                 collate_fn: Callable[[list[dict]], Any] | None = None, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1, bucket: bool = False, bucket_window: int = 64) -> None:
        if batch_size < 1:
            raise RecipeError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, world_size={world_size})")
        if len(dataset) == 0:
            raise RecipeError("the dataset is empty (check dataset.source, split and limit)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.collate_fn = collate_fn if collate_fn is not None else (lambda b: b)
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.bucket = bucket
        self.bucket_window = bucket_window
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out
        self._lengths: list[int] | None = None
        if len(self._rank_indices(0)) < (batch_size if drop_last else 1):
            raise RecipeError(f"the dataset has {len(dataset)} examples: too few for batch_size {batch_size} "
                              f"on {world_size} rank(s) with drop_last")

    # ------------------------------------------------------------------ order
    def _rng(self, epoch: int, salt: int = 0) -> random.Random:
        return random.Random((self.seed * 1_000_003 + epoch) * 7 + salt)

    def _rank_indices(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        order = list(range(n))
        if self.shuffle:
            self._rng(epoch).shuffle(order)
        total = -(-n // self.world_size) * self.world_size
        while len(order) < total:
            order += order[: total - len(order)]
        return order[self.rank :: self.world_size]

    def _lengths_of(self) -> list[int]:
        if self._lengths is None:
            lengths = getattr(self.dataset, "lengths", None)
            self._lengths = list(lengths()) if callable(lengths) else [_item_len(x) for x in self.dataset]
        return self._lengths

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Dataset indices of every batch this rank gets in `epoch`."""
        idx = self._rank_indices(epoch)
        bs = self.batch_size
        if self.bucket:
            lengths = self._lengths_of()
            window = bs * max(1, self.bucket_window)
            batches = []
            for w in range(0, len(idx), window):
                chunk = sorted(idx[w : w + window], key=lambda i: (lengths[i], i))
                batches += [chunk[b : b + bs] for b in range(0, len(chunk), bs)]
            if self.drop_last:
                batches = [b for b in batches if len(b) == bs]
            if self.shuffle:
                self._rng(epoch, salt=1).shuffle(batches)
            return batches
        batches = [idx[b : b + bs] for b in range(0, len(idx), bs)]
        if self.drop_last and batches and len(batches[-1]) < bs:
            batches.pop()
        return batches

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch, then advance to the next epoch."""
        batches = self.epoch_batches(self.epoch)
        while self.position < len(batches):
            b = batches[self.position]
            self.position += 1  # counted before the yield: a checkpoint taken after this step resumes after it
            yield self.collate_fn([self.dataset[i] for i in b])
        self.epoch += 1
        self.position = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        """Position to resume from (plus what must match on resume)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": len(self.dataset),
                "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; refuses if the data or batching changed since it was saved."""
        for key, now in (("num_examples", len(self.dataset)), ("batch_size", self.batch_size),
                         ("seed", self.seed), ("world_size", self.world_size)):
            if key in state and int(state[key]) != now:
                raise RecipeError(f"cannot resume the data loader: {key} was {state[key]} in the checkpoint but is "
                                  f"{now} now; resume with the same dataset and batching, or start a new run")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

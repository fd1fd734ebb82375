"""The ledger of a positional input: which windows each host reads, and where it
stands, under every host count a run has had, from a few integers.

The positional stream (`tputrain.data.positional`) is cut into windows: epoch e's
records, in its block order, in windows of S records (the last window of an epoch
holds the rest, R <= S), numbered on over the epochs (window g is window g % W of
epoch g // W). A window's records are permuted by its number alone, so any host
reads the same records in the same order from it.

Ownership, under H hosts: host h reads first the windows carried over to it (each
from the record where its previous reader stopped), then the fresh windows
`fresh + r + k * H`, k = 0, 1, ..., where r is the host's rank (h itself, unless a
host-count change dealt them by load, below). Every host of a layout reads as many records
(the global batch splits evenly over the hosts), so after E examples consumed
host h stands `(E - start) / H` records into its own sequence: a position is
derived from the examples consumed, whatever the global batch did meanwhile (a
batch change needs no entry), in constant time (window sizes are arithmetic).

A host-count change at E examples: every old host's partly read window, and its
own fresh windows below the first one no host started (the frontier), are carried
over to the new hosts (each to the one with the fewest carried records so far),
and fresh windows start at the frontier, dealt first to the hosts with the fewest
carried records (`by_load`: their ranks), which reach them first: a host with
nothing carried reads the epoch's next window, not one of the next epoch while a
window of this one waits behind another host's carried records. Nothing is read
twice or passed over. Checkpoints written before `by_load` replay their changes in
host order (a history entry's third field marks a change dealt by load).
The ledger holds O(hosts) integers; what the checkpoint holds is less: the host
counts and where each took over (`InputContext.layout_history`), from which every
host replays it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

Piece = tuple[int, int]  # (window, records of it already read)


@dataclasses.dataclass(frozen=True)
class Windows:
    """The windows of a data set: `records` (S) each, the last of an epoch the rest."""

    records: int
    epoch_records: int

    @property
    def per_epoch(self) -> int:
        return math.ceil(self.epoch_records / self.records)

    @property
    def last(self) -> int:
        """Records in an epoch's last window (R)."""
        return self.epoch_records - (self.per_epoch - 1) * self.records

    def size(self, window: int) -> int:
        return self.last if window % self.per_epoch == self.per_epoch - 1 else self.records


def _hits(first: int, stride: int, period: int, target: int, n: int) -> int:
    """How many k in [0, n) have (first + k * stride) % period == target."""
    divisor = math.gcd(stride, period)
    gap = (target - first) % period
    if gap % divisor or n <= 0:
        return 0
    reduced = period // divisor
    k0 = (gap // divisor) * pow(stride // divisor, -1, reduced) % reduced if reduced > 1 else 0
    return 0 if n <= k0 else (n - 1 - k0) // reduced + 1


@dataclasses.dataclass(frozen=True)
class Position:
    """A host's place in its sequence: `pieces` (window, records to skip) to read
    first, then its fresh windows from the `k`-th on, `skip` records into that one."""

    pieces: tuple[Piece, ...]
    k: int
    skip: int


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Which windows the hosts of the current layout read (module docstring).

    Args:
        windows: the data's window shape.
        hosts: input pipelines of the current layout (H).
        start: examples consumed (over all hosts) when this layout took over.
        fresh: the first window no earlier layout started.
        carried: per host, windows it finishes first (window, records already read).
        ranks: per host, its place in the dealing of fresh windows (empty: its index).
    """

    windows: Windows
    hosts: int
    start: int = 0
    fresh: int = 0
    carried: tuple[tuple[Piece, ...], ...] = ()
    ranks: tuple[int, ...] = ()

    def rank(self, host: int) -> int:
        return self.ranks[host] if self.ranks else host

    def fresh_window(self, host: int, k: int) -> int:
        return self.fresh + self.rank(host) + k * self.hosts

    def fresh_records(self, host: int, n: int) -> int:
        """Records in host `host`'s first `n` fresh windows."""
        w = self.windows
        short = _hits(self.fresh_window(host, 0), self.hosts, w.per_epoch, w.per_epoch - 1, n)
        return n * w.records - short * (w.records - w.last)

    def carried_of(self, host: int) -> tuple[Piece, ...]:
        return self.carried[host] if host < len(self.carried) else ()

    def host_records(self, examples: int) -> int:
        """Records each host of this layout has read once `examples` are consumed."""
        if examples < self.start:
            raise ValueError(f"positional input: {examples} examples consumed is before "
                             f"this layout's start at {self.start}")
        return (examples - self.start) // self.hosts

    def locate(self, host: int, records: int) -> Position:
        """Host `host`'s place after reading `records` of its sequence: constant time
        (a bisection over the closed-form record count of its fresh windows)."""
        pieces = self.carried_of(host)
        for i, (window, done) in enumerate(pieces):
            left = self.windows.size(window) - done
            if records < left:
                return Position(((window, done + records),) + pieces[i + 1:], 0, 0)
            records -= left
        low, high = 0, records // self.windows.last + 1  # fresh_records(high) > records
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.fresh_records(host, middle) <= records else (
                low, middle)
        return Position((), low, records - self.fresh_records(host, low))

    def relayout(self, examples: int, hosts: int, by_load: bool = False) -> Ledger:
        """The ledger once `hosts` hosts take over at `examples` consumed (`by_load`:
        fresh windows dealt first to the hosts with the fewest carried records)."""
        places = [self.locate(h, self.host_records(examples)) for h in range(self.hosts)]
        started = [self.fresh_window(h, p.k - (p.skip == 0)) for h, p in enumerate(places)
                   if p.k or p.skip]
        frontier = max(started, default=self.fresh - 1) + 1
        pending: list[Piece] = []
        for host, place in enumerate(places):
            pending += place.pieces
            k = place.k
            if place.skip:
                pending.append((self.fresh_window(host, k), place.skip))
                k += 1
            while self.fresh_window(host, k) < frontier:
                pending.append((self.fresh_window(host, k), 0))
                k += 1
        carried: list[list[Piece]] = [[] for _ in range(hosts)]
        loads = [0] * hosts
        for window, done in pending:
            target = loads.index(min(loads))
            carried[target].append((window, done))
            loads[target] += self.windows.size(window) - done
        ranks: tuple[int, ...] = ()
        if by_load:
            order = sorted(range(hosts), key=lambda host: (loads[host], host))
            ranks = tuple(order.index(host) for host in range(hosts))
        return Ledger(self.windows, hosts, examples, frontier,
                      tuple(tuple(pieces) for pieces in carried),
                      () if ranks == tuple(range(hosts)) else ranks)

    @classmethod
    def replay(cls, windows: Windows, history: Sequence[tuple[int, ...]]) -> Ledger:
        """The ledger after `history`: (examples consumed, hosts) at each host count
        the run had, the first at its start; a third field 1: a change dealt by load."""
        (start, hosts, *_), *changes = history
        ledger = cls(windows, hosts, start)
        for examples, new_hosts, *rule in changes:
            if new_hosts != ledger.hosts:
                ledger = ledger.relayout(examples, new_hosts, by_load=bool(rule and rule[0]))
        return ledger

    def integers(self) -> int:
        """Integers this ledger holds (O(hosts))."""
        return 5 + 2 * sum(len(pieces) for pieces in self.carried) + len(self.ranks)

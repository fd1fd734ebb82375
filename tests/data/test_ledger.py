"""Tests for tputrain.data.ledger: which windows each host reads, across host-count
changes, from a few integers (pure arithmetic: windows of (window, index) records)."""

import collections
import itertools

import pytest

from tputrain.data.ledger import Ledger, Windows


def _sequence(ledger: Ledger, host: int):
    """Host `host`'s records, walked one by one (what `locate` must agree with)."""
    for window, done in ledger.carried_of(host):
        yield from ((window, i) for i in range(done, ledger.windows.size(window)))
    for k in itertools.count():
        window = ledger.fresh_window(host, k)
        yield from ((window, i) for i in range(ledger.windows.size(window)))


def _from(ledger: Ledger, host: int, records: int, count: int) -> list:
    """`count` records of the host from `records` on, as `locate` places them."""
    place = ledger.locate(host, records)
    out = [(w, i) for w, done in place.pieces for i in range(done, ledger.windows.size(w))]
    k, skip = place.k, place.skip
    while len(out) < count:
        window = ledger.fresh_window(host, k)
        out += [(window, i) for i in range(skip, ledger.windows.size(window))]
        k, skip = k + 1, 0
    return out[:count]


@pytest.mark.parametrize("windows", [Windows(10, 100), Windows(10, 95), Windows(7, 22)])
def test_locate_agrees_with_walking_the_sequence(windows):
    for ledger in (Ledger(windows, 3), Ledger(windows, 1), Ledger(windows, 2, 0, 5,
                                                                   (((1, 3), (4, 0)), ())),
                   Ledger(windows, 3, 0, 5, (((1, 3),), (), ((2, 1),)), ranks=(2, 0, 1))):
        for host in range(ledger.hosts):
            walked = list(itertools.islice(_sequence(ledger, host), 400))
            for records in (0, 1, 6, 7, 9, 10, 13, 55, 99, 100, 250, 349):
                assert _from(ledger, host, records, 50) == walked[records:records + 50]


def test_a_far_position_is_found_without_walking():
    ledger = Ledger(Windows(10_240, 1_000_003), 7)
    place = ledger.locate(3, 10**12)
    assert ledger.fresh_records(3, place.k) + place.skip == 10**12
    assert place.skip < ledger.windows.size(ledger.fresh_window(3, place.k))


@pytest.mark.parametrize("by_load", [False, True])
@pytest.mark.parametrize("windows", [Windows(10, 100), Windows(10, 95), Windows(7, 40)])
def test_every_record_once_through_host_changes(windows, by_load):
    """Hosts 2 -> 3 -> 1 -> 4 -> 2 at uneven points (mid-window, window ends): the
    records the hosts read are the first ones of the window stream, each once (fresh
    windows dealt in host order, as checkpoints before `by_load` replay, or by load)."""
    ledger, consumed, seen = Ledger(windows, 2), 0, collections.Counter()
    for hosts, per_host in ((2, 13), (3, 17), (1, 31), (4, 9), (2, 40)):
        if hosts != ledger.hosts:
            ledger = ledger.relayout(consumed, hosts, by_load=by_load)
        for host in range(hosts):
            seen.update(_from(ledger, host, ledger.host_records(consumed), per_host))
        consumed += hosts * per_host
    assert max(seen.values()) == 1
    # The rest of the stream: no record before the last one read was passed over.
    ordinal = {r: n for n, r in enumerate((w, i) for w in range(100) for i in
                                           range(windows.size(w)))}
    last = max(ordinal[r] for r in seen)
    unread = [r for r, n in ordinal.items() if n < last and r not in seen]
    pending = {r for host in range(ledger.hosts)
               for r in _from(ledger, host, ledger.host_records(consumed), 200)}
    assert set(unread) <= pending  # what lies behind the frontier is still owed


def test_replay_is_the_chain_of_relayouts_and_a_batch_change_needs_no_entry():
    windows = Windows(10, 95)
    chained = Ledger(windows, 2).relayout(26, 3).relayout(77, 1)
    assert Ledger.replay(windows, [(0, 2), (26, 3), (77, 1)]) == chained
    assert Ledger.replay(windows, [(0, 2), (40, 2)]) == Ledger(windows, 2)
    # A third field marks a relayout that deals fresh windows by load (this version's).
    mixed = Ledger(windows, 2).relayout(26, 3).relayout(77, 1, by_load=True)
    assert Ledger.replay(windows, [(0, 2), (26, 3), (77, 1, 1)]) == mixed


@pytest.mark.parametrize("changes", [[(120, 3)], [(120, 3), (240, 1)]])
def test_after_a_host_change_no_host_starts_the_next_epoch_while_this_one_has_windows(
        changes):
    """3 windows of 200 an epoch, 2 hosts, then 3 at 120 examples (and 1 at 240): the new
    host was dealt window 4 (the next epoch's) while window 2 waited behind a host's
    carried window, so 480 examples consumed read 111 records twice and 111 not at all.
    Dealt by load, the first 480 examples are 480 records of the first epoch."""
    windows, consumed = Windows(200, 600), 0
    ledger, seen = Ledger(windows, 2), collections.Counter()
    for end, hosts in [*changes, (480, None)]:
        per_host = (end - consumed) // ledger.hosts
        for host in range(ledger.hosts):
            seen.update(_from(ledger, host, ledger.host_records(consumed), per_host))
        consumed = end
        if hosts is not None:
            ledger = ledger.relayout(consumed, hosts, by_load=True)
    assert sum(seen.values()) == 480 and max(seen.values()) == 1
    assert {window for window, _ in seen} <= {0, 1, 2}


def test_the_ledger_is_o_hosts_integers_whatever_the_step():
    """1000 hosts -> 999 at step 10 and at step 1e5 (global batch 4096): a few integers
    per host (each 8 bytes in a checkpoint: far under 64 KB a host)."""
    windows = Windows(10_240, 1_000_000)
    for step in (10, 100_000):
        ledger = Ledger(windows, 1000).relayout(step * 4096, 999)
        assert ledger.integers() <= 5 + 2 * 2 * 1000
        assert ledger.integers() * 8 / 999 < 64 * 1024

"""The two-level LRU table FAFO's pool and Cacheback's follower table share, and each method's rule on it:
a Cacheback read refreshes its leader, a FAFO lookup leaves the pool's order alone."""

from __future__ import annotations

from fafo_cli.decoders.fafo.pool import NgramPool
from fafo_cli.decoders.ngram_table import FollowerTable
from fafo_cli.decoders.ngrams import LruTable


def filled(per_key: int = 2, max_keys: int = 2) -> LruTable:
    table = LruTable(per_key, max_keys)
    table.insert((1,), (10,))
    table.insert((2,), (20,))
    return table


def test_per_key_bound_evicts_the_least_recently_used_entry():
    table = LruTable(per_key=2, max_keys=10)
    for entry in [(1,), (2,), (3,)]:
        table.insert((0,), entry)
    assert list(table.read((0,))) == [(3,), (2,)]
    assert (len(table), table.entries) == (1, 2)


def test_reinserted_entry_is_refreshed_and_not_counted_twice():
    table = LruTable(per_key=2, max_keys=10)
    table.insert((0,), (1,))
    table.insert((0,), (2,))
    table.insert((0,), (1,))  # (2,) is now the oldest
    table.insert((0,), (3,))
    assert list(table.read((0,))) == [(3,), (1,)]
    assert table.entries == 2


def test_key_bound_evicts_the_least_recently_used_key_with_its_entries():
    table = filled()
    table.insert((1,), (11,))  # the insert refreshes (1,): (2,) is the oldest
    table.insert((3,), (30,))
    assert list(table) == [(1,), (3,)]
    assert list(table.read((2,))) == []
    assert table.entries == 3


def test_read_refreshes_the_key_only_when_asked():
    refreshed, kept = filled(), filled()
    assert list(refreshed.read((1,), refresh=True)) == [(10,)]
    assert list(kept.read((1,))) == [(10,)]
    refreshed.insert((3,), (30,))
    kept.insert((3,), (30,))
    assert list(refreshed) == [(1,), (3,)]  # the read saved (1,); (2,) went
    assert list(kept) == [(2,), (3,)]  # the read changed nothing; (1,) went


def test_reads_never_refresh_entries_and_unknown_keys_add_nothing():
    table = LruTable(per_key=2, max_keys=2)
    table.insert((0,), (1,))
    table.insert((0,), (2,))
    assert list(table.read((0,), refresh=True)) == [(2,), (1,)]
    table.insert((0,), (3,))  # (1,) is still the oldest despite the read
    assert list(table.read((0,))) == [(3,), (2,)]
    assert list(table.read((9,), refresh=True)) == []
    assert len(table) == 1


def test_snapshot_keeps_both_orders_without_lru_effects():
    table = filled()
    table.insert((1,), (11,))
    assert table.snapshot() == {(2,): [(20,)], (1,): [(11,), (10,)]}
    assert list(table) == [(2,), (1,)]


# --- each method's rule --------------------------------------------------------------------------------------


def test_cacheback_read_refreshes_a_leader_but_a_fafo_lookup_does_not_refresh_a_key():
    followers = FollowerTable(leader=1, follower=1, followers=2, max_leaders=2)
    pool = NgramPool(ngram=1, prefix=1, per_key=2, max_keys=2)
    for key, value in [((1,), (10,)), ((2,), (20,))]:
        followers.insert(key, value)
        pool.add(list(key), value)
    assert followers.lookup((1,)) == [(10,)]
    assert pool.lookup([1], 5) == [((10,), 1)]
    followers.insert((3,), (30,))
    pool.add([3], (30,))
    assert followers.lookup((1,)) == [(10,)] and followers.lookup((2,)) == []
    assert pool.lookup([1], 5) == [] and pool.lookup([2], 5) == [((20,), 1)]


def test_fafo_add_refreshes_the_keys_it_stores_under_shortest_first():
    pool = NgramPool(ngram=1, prefix=2, per_key=2, max_keys=2)
    pool.add([1, 2], (3,))  # under (2,), then (1, 2): the longer key is the more recent
    pool.add([5], (6,))  # a third key: (2,) goes
    assert pool.lookup([7, 2], 5) == []
    assert pool.lookup([1, 2], 5) == [((3,), 2)]
    assert (pool.keys, pool.ngrams) == (2, 2)


def test_fafo_reinserted_ngram_is_refreshed_within_its_key():
    pool = NgramPool(ngram=1, prefix=1, per_key=2)
    for ngram in (1, 2, 1):  # under (0,): 1, 2, then 1 again
        pool.add([0], (ngram,))
    assert pool.lookup([0], 5) == [((1,), 1), ((2,), 1)]
    pool.add([0], (3,))  # 2 is the oldest, not 1
    assert pool.lookup([0], 5) == [((3,), 1), ((1,), 1)]

"""Cacheback's n-gram tables: two-level LRU semantics, text windows, the saved file and its errors."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fafo_cli.decoders.ngram_table import (FollowerTable, FrozenTable, build_from_files, build_table, check_corpus,
                                           tokenizer_fingerprint)
from fafo_cli.errors import FafoError


def one_line(error: pytest.ExceptionInfo[FafoError]) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


# --- LRU semantics --------------------------------------------------------------------------------------------


def test_new_leader_beyond_capacity_evicts_least_recently_used():
    table = FollowerTable(leader=1, follower=1, followers=2, max_leaders=2)
    table.insert((1,), (10,))
    table.insert((2,), (20,))
    table.insert((3,), (30,))  # (1,) is the oldest: evicted with its follower
    assert table.lookup((1,)) == []
    assert table.lookup((2,)) == [(20,)]
    assert table.lookup((3,)) == [(30,)]
    assert (table.leaders, table.entries) == (2, 2)


def test_lookup_refreshes_leader():
    table = FollowerTable(leader=1, follower=1, followers=2, max_leaders=2)
    table.insert((1,), (10,))
    table.insert((2,), (20,))
    assert table.lookup((1,)) == [(10,)]  # the read makes (2,) the oldest
    table.insert((3,), (30,))
    assert table.lookup((1,)) == [(10,)]
    assert table.lookup((2,)) == []
    assert table.leaders == 2


def test_lookup_of_unknown_leader_changes_nothing():
    table = FollowerTable(leader=1, follower=1, followers=2, max_leaders=2)
    table.insert((1,), (10,))
    table.insert((2,), (20,))
    assert table.lookup((9,)) == []
    table.insert((3,), (30,))
    assert table.lookup((1,)) == []
    assert table.leaders == 2


def test_insert_refreshes_leader():
    table = FollowerTable(leader=1, follower=1, followers=2, max_leaders=2)
    table.insert((1,), (10,))
    table.insert((2,), (20,))
    table.insert((1,), (11,))  # (2,) is now the oldest
    table.insert((3,), (30,))
    assert table.lookup((2,)) == []
    assert table.lookup((1,)) == [(11,), (10,)]


def test_lookup_does_not_refresh_followers():
    table = FollowerTable(leader=1, follower=2, followers=3)
    for follower in [(1, 1), (2, 2), (3, 3)]:
        table.insert((0,), follower)
    assert table.lookup((0,)) == [(3, 3), (2, 2), (1, 1)]
    assert table.lookup((0,)) == [(3, 3), (2, 2), (1, 1)]
    table.insert((0,), (4, 4))  # (1, 1) is still the oldest despite the reads
    assert table.lookup((0,)) == [(4, 4), (3, 3), (2, 2)]


def test_reinsert_moves_follower_to_front():
    table = FollowerTable(leader=1, follower=2, followers=3)
    for follower in [(1, 1), (2, 2), (3, 3), (1, 1)]:
        table.insert((0,), follower)
    assert table.lookup((0,)) == [(1, 1), (3, 3), (2, 2)]
    assert table.entries == 3
    table.insert((0,), (4, 4))  # (2, 2) became the oldest
    assert table.lookup((0,)) == [(4, 4), (1, 1), (3, 3)]


def test_followers_evicted_oldest_first_per_leader():
    table = FollowerTable(leader=1, follower=1, followers=2)
    for follower in range(5):
        table.insert((7,), (follower,))
    table.insert((8,), (0,))
    assert table.lookup((7,)) == [(4,), (3,)]
    assert table.lookup((8,)) == [(0,)]
    assert (table.leaders, table.entries) == (2, 3)


def test_entries_drop_with_evicted_leader():
    table = FollowerTable(leader=1, follower=1, followers=3, max_leaders=1)
    for follower in range(3):
        table.insert((1,), (follower,))
    assert table.entries == 3
    table.insert((2,), (5,))
    assert (table.leaders, table.entries) == (1, 1)


def test_insert_checks_lengths_and_config_is_validated():
    table = FollowerTable(leader=2, follower=3, followers=4)
    assert (table.leader_length, table.follower_length) == (2, 3)
    with pytest.raises(ValueError):
        table.insert((1,), (1, 2, 3))
    with pytest.raises(ValueError):
        table.insert((1, 2), (1, 2))
    with pytest.raises(FafoError) as error:
        FollowerTable(leader=1, follower=3, followers=0)
    assert one_line(error) == "cacheback followers per leader must be at least 1, got 0"


# --- add_text windows -----------------------------------------------------------------------------------------


def test_add_text_leader_one():
    table = FollowerTable(leader=1, follower=2, followers=4)
    table.add_text([1, 2, 3, 1, 2, 4])
    # windows: (1)->(2,3) (2)->(3,1) (3)->(1,2) (1)->(2,4); tokens 4 has no complete follower
    assert table.lookup((1,)) == [(2, 4), (2, 3)]
    assert table.lookup((2,)) == [(3, 1)]
    assert table.lookup((3,)) == [(1, 2)]
    assert table.lookup((4,)) == []
    assert (table.leaders, table.entries) == (3, 4)


def test_add_text_leader_two():
    table = FollowerTable(leader=2, follower=1, followers=4)
    table.add_text([5, 6, 7, 5, 6, 8])
    # windows: (5,6)->7 (6,7)->5 (7,5)->6 (5,6)->8
    assert table.lookup((5, 6)) == [(8,), (7,)]
    assert table.lookup((6, 7)) == [(5,)]
    assert table.lookup((7, 5)) == [(6,)]
    assert (table.leaders, table.entries) == (3, 4)


def test_add_text_too_short_adds_nothing():
    table = FollowerTable(leader=2, follower=2, followers=4)
    table.add_text([1, 2, 3])
    table.add_text([])
    assert (table.leaders, table.entries) == (0, 0)


def test_add_text_new_only_windows_ending_in_tail():
    tokens = [1, 2, 3, 4, 5, 6]
    table = FollowerTable(leader=1, follower=2, followers=4)
    table.add_text(tokens, new=2)
    # followers ending in the last two tokens: (4,5) ending at 5, (5,6) ending at 6
    assert table.lookup((3,)) == [(4, 5)]
    assert table.lookup((4,)) == [(5, 6)]
    assert table.entries == 2

    table = FollowerTable(leader=2, follower=1, followers=4)
    table.add_text(tokens, new=1)
    assert table.lookup((4, 5)) == [(6,)]
    assert table.entries == 1

    table = FollowerTable(leader=1, follower=2, followers=4)
    table.add_text(tokens, new=0)
    assert table.entries == 0


def test_add_text_incremental_equals_whole():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3, 1, 2, 6, 7]
    whole = FollowerTable(leader=2, follower=1, followers=2)
    whole.add_text(tokens)
    pieces = FollowerTable(leader=2, follower=1, followers=2)
    for end, new in [(3, 3), (7, 4), (8, 1), (16, 8)]:  # fresh text arriving in pieces, each window once
        pieces.add_text(tokens[:end], new=new)
    # (1, 2) saw 3, 4, 5, 3, 6: capacity 2 keeps the two most recent
    assert pieces.lookup((1, 2)) == whole.lookup((1, 2)) == [(6,), (3,)]
    assert pieces.freeze().snapshot() == whole.freeze().snapshot()
    assert (pieces.leaders, pieces.entries) == (whole.leaders, whole.entries) == (8, 9)


# --- freeze, save, load ---------------------------------------------------------------------------------------


def sample_table() -> FollowerTable:
    table = FollowerTable(leader=2, follower=3, followers=3)
    table.add_text([1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 2, 3, 4, 1])
    return table


def test_freeze_keeps_order_and_has_no_lru_effects():
    table = sample_table()
    frozen = table.freeze()
    assert (frozen.leader_length, frozen.follower_length) == (2, 3)
    assert (frozen.leaders, frozen.entries) == (table.leaders, table.entries) == (9, 12)
    assert frozen.lookup((1, 2)) == [(3, 7, 2), (5, 6, 1), (3, 4, 1)]
    assert frozen.lookup([1, 2]) == table.lookup((1, 2))
    frozen.lookup((1, 2)).clear()  # a returned list is the caller's own
    assert frozen.lookup((1, 2)) == [(3, 7, 2), (5, 6, 1), (3, 4, 1)]
    assert frozen.lookup((9, 9)) == []


def test_save_load_round_trip(tmp_path):
    table = sample_table()
    frozen = table.freeze()
    path = tmp_path / "table.safetensors"
    frozen.save(path, "abc123")
    loaded = FrozenTable.load(path, "abc123")
    assert (loaded.leader_length, loaded.follower_length) == (2, 3)
    assert (loaded.leaders, loaded.entries) == (9, 12)
    for leader in frozen.snapshot():
        assert loaded.lookup(leader) == frozen.lookup(leader) != []
    assert loaded.lookup((1, 2)) == [(3, 7, 2), (5, 6, 1), (3, 4, 1)]
    assert sorted(os.listdir(tmp_path)) == ["table.safetensors"]  # no .partial left behind


def test_saved_file_layout(tmp_path):
    path = tmp_path / "table.safetensors"
    build_table([[1, 2, 3, 1, 4, 5]], leader=1, follower=2, followers=2).save(path, "abc123")
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "fafo-cacheback-table", "version": "1", "leader_length": "1",
                                "follower_length": "2", "tokenizer_fingerprint": "abc123"}
        leaders, offsets, followers = (f.get_tensor(name) for name in ("leaders", "offsets", "followers"))
    assert (leaders.dtype, followers.dtype) == (torch.int32, torch.int32)
    # leaders oldest first; followers of each leader most recent first
    assert leaders.tolist() == [[2], [3], [1]]
    assert offsets.tolist() == [0, 1, 2, 4]
    assert followers.tolist() == [[3, 1], [1, 4], [4, 5], [2, 3]]


def test_save_load_empty_table(tmp_path):
    path = tmp_path / "empty.safetensors"
    FollowerTable(leader=1, follower=3, followers=2).freeze().save(path, "fp")
    loaded = FrozenTable.load(str(path), "fp")
    assert (loaded.leaders, loaded.entries, loaded.leader_length, loaded.follower_length) == (0, 0, 1, 3)


def test_save_overwrites_atomically(tmp_path):
    path = tmp_path / "t.safetensors"
    build_table([[1, 2, 3, 4]], 1, 1, 2).save(path, "fp")
    build_table([[5, 6, 7]], 1, 1, 2).save(path, "fp")
    loaded = FrozenTable.load(path, "fp")
    assert loaded.lookup((5,)) == [(6,)]
    assert loaded.lookup((1,)) == []
    assert sorted(os.listdir(tmp_path)) == ["t.safetensors"]


def test_failed_save_leaves_no_partial_and_keeps_old_file(tmp_path, monkeypatch):
    import fafo_cli.files as module  # where the rename happens

    path = tmp_path / "t.safetensors"
    build_table([[1, 2, 3]], 1, 1, 2).save(path, "fp")
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.os, "replace", broken_replace)
    with pytest.raises(FafoError) as error:
        build_table([[7, 8, 9]], 1, 1, 2).save(path, "fp")
    assert one_line(error) == f"cannot write cacheback table {path}: No space left on device"
    assert sorted(os.listdir(tmp_path)) == ["t.safetensors"]
    assert path.read_bytes() == before


def test_save_into_missing_folder_is_one_line_error(tmp_path):
    path = tmp_path / "nope" / "t.safetensors"
    with pytest.raises(FafoError) as error:
        build_table([[1, 2, 3]], 1, 1, 2).save(path, "fp")
    assert one_line(error).startswith(f"cannot write cacheback table {path}: ")
    assert not (tmp_path / "nope").exists()


def test_load_missing_file(tmp_path):
    path = tmp_path / "missing.safetensors"
    with pytest.raises(FafoError) as error:
        FrozenTable.load(path, "fp")
    assert one_line(error) == f"cacheback table not found: {path}"


def test_load_folder(tmp_path):
    with pytest.raises(FafoError) as error:
        FrozenTable.load(tmp_path, "fp")
    assert one_line(error) == f"{tmp_path} is a folder, not a cacheback table file"


@pytest.mark.parametrize("content", [os.urandom(200), b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}"])
def test_load_non_table_file(tmp_path, content):
    path = tmp_path / "random.bin"
    path.write_bytes(content)
    with pytest.raises(FafoError) as error:
        FrozenTable.load(path, "fp")
    assert one_line(error) == f"{path} is not a fafo cacheback table"


@pytest.mark.parametrize("metadata,tensors", [
    (None, None),  # a safetensors file without any metadata
    ({"format": "something-else", "version": "1"}, None),
    ({"format": "fafo-cacheback-table", "version": "99"}, None),
    ({"format": "fafo-cacheback-table", "version": "1", "leader_length": "x", "follower_length": "1",
      "tokenizer_fingerprint": "fp"}, None),
    ({"format": "fafo-cacheback-table", "version": "1", "leader_length": "1", "follower_length": "1",
      "tokenizer_fingerprint": "fp"}, {"leaders": torch.zeros(2, 1, dtype=torch.int32)}),  # tensors missing
    ({"format": "fafo-cacheback-table", "version": "1", "leader_length": "1", "follower_length": "1",
      "tokenizer_fingerprint": "fp"},
     {"leaders": torch.zeros(2, 1, dtype=torch.int32), "offsets": torch.tensor([0, 1, 5]),
      "followers": torch.zeros(3, 1, dtype=torch.int32)}),  # offsets point past the followers
])
def test_load_safetensors_that_is_not_a_table(tmp_path, metadata, tensors):
    path = tmp_path / "other.safetensors"
    save_file(tensors or {"weight": torch.zeros(2, 2)}, str(path), metadata=metadata)
    with pytest.raises(FafoError) as error:
        FrozenTable.load(path, "fp")
    assert one_line(error) == f"{path} is not a fafo cacheback table"


def test_load_truncated_table(tmp_path):
    path = tmp_path / "t.safetensors"
    sample_table().freeze().save(path, "fp")
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(FafoError) as error:
        FrozenTable.load(path, "fp")
    assert one_line(error) == f"{path} is not a fafo cacheback table"


def test_load_fingerprint_mismatch(tmp_path):
    path = tmp_path / "t.safetensors"
    sample_table().freeze().save(path, "aaaa")
    with pytest.raises(FafoError) as error:
        FrozenTable.load(path, "bbbb")
    assert one_line(error) == (f"cacheback table {path} was built with a different tokenizer; "
                               "rebuild it for this model")


def test_load_unreadable(tmp_path, monkeypatch):
    import fafo_cli.decoders.ngram_table as module

    path = tmp_path / "t.safetensors"
    sample_table().freeze().save(path, "fp")

    def denied(*args, **kwargs):  # chmod does not stop root, so the denial is simulated
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(module, "safe_open", denied)
    with pytest.raises(FafoError) as error:
        FrozenTable.load(path, "fp")
    assert one_line(error) == f"cannot read cacheback table {path}: Permission denied"


# --- fingerprint, build_table, read_corpus --------------------------------------------------------------------


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_tokenizer_fingerprint_is_stable_and_vocab_sensitive():
    a = tokenizer_fingerprint(FakeTokenizer({"a": 0, "b": 1, "\n": 2}))
    assert a == tokenizer_fingerprint(FakeTokenizer({"\n": 2, "b": 1, "a": 0}))  # insertion order is irrelevant
    assert len(a) == 16 and int(a, 16) >= 0
    assert a != tokenizer_fingerprint(FakeTokenizer({"a": 0, "b": 2, "\n": 1}))
    assert a != tokenizer_fingerprint(FakeTokenizer({"a": 0, "b": 1}))


def test_build_table_does_not_cross_stream_boundaries():
    frozen = build_table([[1, 2, 3], [4, 5], [6, 7, 8]], leader=1, follower=2, followers=4)
    assert frozen.lookup((1,)) == [(2, 3)]
    assert frozen.lookup((6,)) == [(7, 8)]
    # joined, the streams would give (2,)->(3,4), (3,)->(4,5), (4,)->(5,6), (5,)->(6,7)
    for leader in [(2,), (3,), (4,), (5,), (7,)]:
        assert frozen.lookup(leader) == []
    assert (frozen.leaders, frozen.entries) == (2, 2)


def test_build_table_later_streams_are_more_recent():
    frozen = build_table([[1, 2], [1, 3], [1, 2]], leader=1, follower=1, followers=4, max_leaders=10)
    assert frozen.lookup((1,)) == [(2,), (3,)]


def test_a_corpus_is_read_and_tokenized_a_piece_at_a_time_as_if_whole(tmp_path, monkeypatch):
    """Pieces end at a line's end and join into the file's text; the table built from them, windows across two
    pieces included and none counted twice, is the table of each whole file's tokens (none across two files)."""
    from fafo_cli.decoders import ngram_table

    first = "".join(f"line {i} héllo ✓ and some more words\n" for i in range(40))
    second = "another file, without a last newline"
    (tmp_path / "a.txt").write_text(first, encoding="utf-8")
    (tmp_path / "b.txt").write_text(second, encoding="utf-8")
    pieces = list(ngram_table.text_pieces(tmp_path / "a.txt", size=100))
    assert len(pieces) > 5 and "".join(pieces) == first and all(piece.endswith("\n") for piece in pieces)
    monkeypatch.setattr(ngram_table, "PIECE_CHARACTERS", 37)  # (pieces far shorter than the file)
    paths = check_corpus([tmp_path / "a.txt", str(tmp_path / "b.txt")])  # Path or str

    def encode(text: str) -> list[int]:
        return [ord(c) % 50 for c in text]  # (few ids: windows recur, their order matters)

    table, tokens = build_from_files(paths, encode, leader=2, follower=3, followers=3, max_leaders=10_000)
    whole = build_table([encode(first), encode(second)], leader=2, follower=3, followers=3, max_leaders=10_000)
    assert tokens == len(first) + len(second) and (table.leaders, table.entries) == (whole.leaders, whole.entries)
    for leader in {tuple(encode(first)[i:i + 2]) for i in range(len(first) - 2)}:
        assert table.lookup(leader) == whole.lookup(leader), leader


def test_corpus_errors(tmp_path, monkeypatch):
    missing = tmp_path / "missing.txt"
    with pytest.raises(FafoError) as error:
        check_corpus([missing])
    assert one_line(error) == f"corpus file not found: {missing}"
    with pytest.raises(FafoError) as error:
        check_corpus([tmp_path])
    assert one_line(error) == f"{tmp_path} is a folder; give the corpus as text files"

    binary = tmp_path / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(FafoError) as error:
        build_from_files(check_corpus([binary]), list, 1, 1, 1, 10)
    assert one_line(error) == f"corpus file {binary} is not UTF-8 text"

    empty, blank = tmp_path / "empty.txt", tmp_path / "blank.txt"
    empty.write_text("")
    blank.write_text(" \n\n")
    for paths in ([empty], [empty, blank], []):
        with pytest.raises(FafoError) as error:
            build_from_files(paths, lambda text: [ord(c) for c in text], 1, 1, 1, 10)
        assert one_line(error) == "no text in the given files"

    path = tmp_path / "locked.txt"
    path.write_text("text")

    def denied(self, *args, **kwargs):  # chmod does not stop root, so the denial is simulated
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "open", denied)
    with pytest.raises(FafoError) as error:
        check_corpus([path])
    assert one_line(error) == f"cannot read corpus file {path}: Permission denied"

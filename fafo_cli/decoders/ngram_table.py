"""Cacheback's n-gram tables: a leader (the last LL tokens) maps to at most FC followers (the next FL tokens).

Both levels are LRU. Reading a leader refreshes it; a follower is refreshed only when it is inserted again,
so the followers' order records what the text did most recently, not what the drafter happened to read
(the two-level LRU table is FAFO's pool's too: `decoders/ngrams.py`).
A FollowerTable learns online; a FrozenTable is its read-only snapshot, built offline from a corpus and
stored as one safetensors file tied to the tokenizer that produced its token ids. Host memory only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as serialize

from fafo_cli.decoders.ngrams import LruTable, Tokens
from fafo_cli.errors import FafoError
from fafo_cli.files import user_path, write_atomic

FORMAT = "fafo-cacheback-table"
VERSION = "1"


class FollowerTable:
    def __init__(self, leader: int, follower: int, followers: int, max_leaders: int = 1_000_000):
        for name, value in (("leader length", leader), ("follower length", follower),
                            ("followers per leader", followers), ("max leaders", max_leaders)):
            if value < 1:
                raise FafoError(f"cacheback {name} must be at least 1, got {value}")
        self.leader_length, self.follower_length = leader, follower
        self.followers, self.max_leaders = followers, max_leaders
        self._table = LruTable(followers, max_leaders)

    @property
    def leaders(self) -> int:
        return len(self._table)

    @property
    def entries(self) -> int:
        return self._table.entries

    def insert(self, leader: Sequence[int], follower: Sequence[int]) -> None:
        """Store `follower` under `leader`, refreshing both (inserting a known pair only refreshes it)."""
        leader, follower = tuple(leader), tuple(follower)
        if len(leader) != self.leader_length or len(follower) != self.follower_length:
            raise ValueError(f"expected a {self.leader_length}-token leader and a {self.follower_length}-token "
                             f"follower, got {len(leader)} and {len(follower)}")
        self._table.insert(leader, follower)

    def lookup(self, leader: Sequence[int]) -> list[Tokens]:
        """The followers of `leader`, most recent first; refreshes the leader but not its followers."""
        return list(self._table.read(tuple(leader), refresh=True))

    def add_text(self, tokens: Sequence[int], new: int | None = None) -> None:
        """Insert every (leader, follower) window of `tokens` in text order, so later occurrences end up
        most recent; with `new`, only the windows whose follower ends within the last `new` tokens."""
        ll, fl = self.leader_length, self.follower_length
        first = ll if new is None else max(ll, len(tokens) - new - fl + 1)  # only the tail is read
        tokens = tuple(tokens[max(0, first - ll):])  # tuple slices are tuples: no per-window conversion
        insert = self._table.insert
        for i in range(ll, len(tokens) - fl + 1):
            insert(tokens[i - ll:i], tokens[i:i + fl])

    def add_stream(self, pieces: Iterable[Sequence[int]]) -> int:
        """Insert the windows of one text given in consecutive pieces (a large file tokenized a part at a time), as
        `add_text` would insert the whole text's; returns its number of tokens."""
        keep = self.leader_length + self.follower_length - 1  # the tokens a window reaches back past a piece
        tail: tuple[int, ...] = ()
        count = 0
        for piece in pieces:
            tokens = tail + tuple(piece)
            self.add_text(tokens, new=len(piece))
            tail, count = tokens[len(tokens) - keep:], count + len(piece)
        return count

    def freeze(self) -> FrozenTable:
        """A read-only snapshot: same leaders, same followers in the same order."""
        return FrozenTable(self.leader_length, self.follower_length, self._table.snapshot())


def table_file(path: str | Path) -> Path:
    """`path` as a table file to read: one clear error where there is none (before a model loads, from the CLI)."""
    path = user_path(path)
    if not path.exists():
        raise FafoError(f"cacheback table not found: {path}")
    if path.is_dir():
        raise FafoError(f"{path} is a folder, not a cacheback table file")
    return path


class FrozenTable:
    """Read-only leader -> followers (most recent first); lookups have no LRU effects."""

    def __init__(self, leader_length: int, follower_length: int, table: dict[Tokens, list[Tokens]]):
        self.leader_length, self.follower_length = leader_length, follower_length
        self._table = table
        self.entries = sum(len(found) for found in table.values())

    @property
    def leaders(self) -> int:
        return len(self._table)

    def lookup(self, leader: Sequence[int]) -> list[Tokens]:
        return list(self._table.get(tuple(leader), ()))  # a copy: callers cannot edit the table

    def snapshot(self) -> dict[Tokens, list[Tokens]]:
        """Every leader with its followers, most recent first (a copy)."""
        return {leader: list(found) for leader, found in self._table.items()}

    def save(self, path: str | Path, tokenizer_fingerprint: str) -> None:
        """Write the table to `path` atomically: a `.partial` sibling is written, then renamed over it."""
        path = user_path(path)
        ll, fl = self.leader_length, self.follower_length
        leaders = [token for leader in self._table for token in leader]
        followers = [token for found in self._table.values() for follower in found for token in follower]
        offsets = [0]
        for found in self._table.values():
            offsets.append(offsets[-1] + len(found))
        tensors = {
            "leaders": torch.tensor(leaders, dtype=torch.int32).reshape(-1, ll),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
            "followers": torch.tensor(followers, dtype=torch.int32).reshape(-1, fl),
        }
        metadata = {"format": FORMAT, "version": VERSION, "leader_length": str(ll),
                    "follower_length": str(fl), "tokenizer_fingerprint": tokenizer_fingerprint}
        data = serialize(tensors, metadata=metadata)  # in memory, so only plain OSErrors come from the write
        try:
            write_atomic(path, data)
        except OSError as e:
            raise FafoError(f"cannot write cacheback table {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | Path, tokenizer_fingerprint: str) -> FrozenTable:
        """Read a table written by `save`; it must have been built with the same tokenizer."""
        path = table_file(path)
        not_table = FafoError(f"{path} is not a fafo cacheback table")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except OSError as e:
            raise FafoError(f"cannot read cacheback table {path}: {e.strerror or e}") from None
        except (SafetensorError, ValueError, RuntimeError):
            raise not_table from None
        if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
            raise not_table
        try:
            ll, fl = int(metadata["leader_length"]), int(metadata["follower_length"])
            fingerprint = metadata["tokenizer_fingerprint"]
            table = _unpack(tensors, ll, fl)
        except (KeyError, ValueError):
            raise not_table from None
        if fingerprint != tokenizer_fingerprint:
            raise FafoError(f"cacheback table {path} was built with a different tokenizer; rebuild it for this model")
        return cls(ll, fl, table)


def _unpack(tensors: dict[str, Any], ll: int, fl: int) -> dict[Tokens, list[Tokens]]:
    """The lookup dict from the saved tensors; ValueError where their shapes or offsets disagree."""
    leaders, offsets, followers = tensors["leaders"], tensors["offsets"], tensors["followers"]
    n = leaders.shape[0] if leaders.dim() == 2 else -1
    if (ll < 1 or fl < 1 or leaders.dtype != torch.int32 or followers.dtype != torch.int32
            or offsets.dtype != torch.int64 or tuple(leaders.shape) != (n, ll) or followers.dim() != 2
            or followers.shape[1] != fl or tuple(offsets.shape) != (n + 1,)):
        raise ValueError("bad tensor shapes")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != followers.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError("bad offsets")
    rows = [tuple(row) for row in followers.tolist()]
    return {tuple(leader): rows[bounds[i]:bounds[i + 1]] for i, leader in enumerate(leaders.tolist())}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short stable hash of the vocabulary: a table's token ids mean nothing under another tokenizer."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(vocab.encode("utf-8")).hexdigest()[:16]


def build_table(token_streams: Iterable[Sequence[int]], leader: int, follower: int, followers: int,
                max_leaders: int = 1_000_000) -> FrozenTable:
    """A frozen table of every stream's windows; a window never spans two streams."""
    table = FollowerTable(leader, follower, followers, max_leaders)
    for tokens in token_streams:
        table.add_stream([tokens])
    return table.freeze()


PIECE_CHARACTERS = 1 << 20  # a corpus file is read and tokenized this much at a time (to a line's end)


def check_corpus(paths: Sequence[str | Path]) -> list[Path]:
    """The corpus files, each checked to be a readable file (before a tokenizer loads: its text is read later,
    a piece at a time, by `text_pieces`)."""
    files = []
    for path in (user_path(p) for p in paths):
        if not path.exists():
            raise FafoError(f"corpus file not found: {path}")
        if path.is_dir():
            raise FafoError(f"{path} is a folder; give the corpus as text files")
        try:
            with path.open("rb") as file:
                file.read(1)
        except OSError as e:
            raise FafoError(f"cannot read corpus file {path}: {e.strerror or e}") from None
        files.append(path)
    return files


def text_pieces(path: Path, size: int = PIECE_CHARACTERS) -> Iterator[str]:
    """The UTF-8 text of a corpus file in pieces of about `size` characters, each ending at a line's end (where a
    tokenizer's pieces end anyway; or at twice `size` within a longer line): a large corpus is never held, nor
    tokenized, whole."""
    try:
        with path.open(encoding="utf-8") as file:
            while piece := file.read(size):
                yield piece + file.readline(size)  # (a line longer than that is cut: memory stays bounded)
    except UnicodeDecodeError:
        raise FafoError(f"corpus file {path} is not UTF-8 text") from None
    except OSError as e:
        raise FafoError(f"cannot read corpus file {path}: {e.strerror or e}") from None


def build_from_files(paths: Sequence[Path], encode: Callable[[str], list[int]], leader: int, follower: int,
                     followers: int, max_leaders: int) -> tuple[FrozenTable, int]:
    """A frozen table of the corpus files' windows (none across two files), each file read and `encode`d a piece
    at a time; and the number of tokens read."""
    table, tokens, text = FollowerTable(leader, follower, followers, max_leaders), 0, False
    for path in paths:
        def encoded() -> Iterator[list[int]]:
            nonlocal text
            for piece in text_pieces(path):
                text = text or bool(piece.strip())
                yield encode(piece)
        tokens += table.add_stream(encoded())
    if not text:  # whitespace alone gives a table nothing to learn
        raise FafoError("no text in the given files")
    return table.freeze(), tokens

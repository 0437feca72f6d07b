"""What a server needs from the engine: stop strings cut inside accepted multi-token steps, and earlier
conversations kept (bounded) so that clients taking turns each prefill only their new tokens, exactly."""

from __future__ import annotations

import pytest
import torch

from fafo_cli import load
from fafo_cli.errors import FafoError
from fafo_cli.runtime.conversations import KeptConversation, KeptConversations
from fafo_cli.runtime.detok import Detokenizer
from fafo_cli.runtime.sampling import Sampling
from fafo_cli.runtime.session import Emitter, Request
from fafo_cli.runtime.stops import StopStrings

from .conftest import LONG, hf_greedy

REPEATS = "abc abc abc abc abc abc abc abc abc abc"


@pytest.mark.parametrize("stops, pieces, released, found", [
    (("END",), ["hello ", "world"], ["hello ", "world"], False),
    (("END",), ["hello E", "N", "D more"], ["hello ", "", ""], True),
    (("END",), ["hello E", "x"], ["hello ", "Ex"], False),  # a false start is released once settled
    (("END",), ["aEN", "EN", "D"], ["a", "EN", ""], True),  # the held tail restarts inside itself
    (("\n\n", "User:"), ["one\n", "Use", "r: two"], ["one", "\n", ""], True),
    (("xy", "y"), ["ay"], ["a"], True),  # any of the strings stops
    (("bc", "abcd"), ["ab", "cd"], ["", ""], True),  # the earliest occurrence wins ("abcd" at 0, not "bc" at 1)
])
def test_stop_strings_release_only_settled_text(stops, pieces, released, found):
    matcher = StopStrings(stops)
    out = [matcher.feed(piece) for piece in pieces]
    assert (out, matcher.found) == (released, found)
    text = "".join(pieces)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    assert "".join(out) + ("" if found else matcher.flush()) == text[:cut]


def test_empty_stop_string_is_refused(tiny):
    with pytest.raises(ValueError):
        StopStrings(("a", ""))
    engine = load(str(tiny), dtype="float32", chat_template=False)
    with pytest.raises(FafoError, match="stop string"):
        engine.complete("hi", stop=[""], max_tokens=4)


@pytest.fixture(scope="module")
def fafo_engine(tiny):
    return load(str(tiny), dtype="float32", chat_template=False, method="fafo", compressor="stream", budget=16, sink=2)


def test_stop_string_inside_a_multi_token_step(fafo_engine):
    """A step that emits several tokens at once (accepted guesses) and completes a stop string in its middle: the
    text ends before the stop string, the tokens with the one completing it, and finish_reason is stop."""
    tokenizer = fafo_engine.tokenizer
    ids = tokenizer("hello END world")["input_ids"]  # byte tokens: one per character
    request = Request([1, 2, 3], 50, Sampling(), frozenset(), fafo_engine.config, ("END", "never"))
    emitter = Emitter(fafo_engine.session, request, tokenizer)
    first = emitter.emit(ids[:7])  # "hello E": the "E" may begin the stop string, so it is held back
    assert first.text == "hello " and first.finish_reason is None
    step = emitter.emit(ids[7:], drafted=8, accepted=7)  # "ND world" in one step
    assert step.finish_reason == "stop" and step.text == ""
    assert list(step.token_ids) == ids[7:9]  # up to the "D" that completes "END"
    assert step.accepted == 2 and step.stats.generated_tokens == 9  # both kept tokens were accepted guesses


def test_a_stop_string_completed_in_held_back_bytes_is_a_stop(fafo_engine):
    """The limit's last token completes a stop string, but its text ends in an incomplete character and is held back
    until the answer's end flushes it: the answer still stopped at the string."""

    class Pieces:  # token 1: "EN", token 2: "D" plus the first byte of a character it never completes
        def decode(self, ids, **_):
            return "".join({1: "EN", 2: "D\ufffd"}[t] for t in ids)

    request = Request([1, 2, 3], 2, Sampling(), frozenset(), fafo_engine.config, ("END",))
    step = Emitter(fafo_engine.session, request, Pieces()).emit([1, 2])
    assert step.finish_reason == "stop" and step.text == ""


def test_a_stop_string_before_an_incomplete_character_stops_at_its_own_token(fafo_engine):
    """A token that completes a stop string and begins a multi-byte character (byte-level BPE merges such bytes):
    the text before the character is settled, so the answer stops at that token, not at the next one."""

    class Bytes:  # token 2: "D" and the first two bytes of "€", which token 3 completes
        pieces = {1: b"EN", 2: b"D\xe2\x82", 3: b"\xac!", 4: b" more"}

        def decode(self, ids, **_):
            return b"".join(self.pieces[t] for t in ids).decode("utf-8", errors="replace")

    request = Request([1, 2, 3], 10, Sampling(), frozenset(), fafo_engine.config, ("END",))
    step = Emitter(fafo_engine.session, request, Bytes()).emit([1, 2, 3, 4])
    assert step.finish_reason == "stop" and step.text == "" and list(step.token_ids) == [1, 2]
    detok = Detokenizer(Bytes())
    assert [detok.add([t]) for t in (1, 2, 3, 4)] == ["EN", "D", "€!", " more"] and detok.flush() == ""
    assert detok.add([2]) == "D" and detok.flush() == "\ufffd"  # never completed: shown at the end


def test_engine_stops_at_a_stop_string(fafo_engine):
    steps = list(fafo_engine.stream(REPEATS, max_tokens=60))
    full = "".join(step.text for step in steps)
    token_ids = [t for step in steps for t in step.token_ids]
    at = next(i for i in range(8, len(full) - 2) if full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    stop = full[at:at + 2]
    result = fafo_engine.complete(REPEATS, max_tokens=60, stop=[stop, "never appears"])
    assert result.finish_reason == "stop" and result.text == full[:at]
    assert result.token_ids == token_ids[:len(result.token_ids)] and len(result.token_ids) < len(token_ids)
    assert result.stats.generated_tokens == len(result.token_ids)
    # the last token kept completes the stop string
    assert stop in fafo_engine.tokenizer.decode(result.token_ids)
    assert stop not in fafo_engine.tokenizer.decode(result.token_ids[:-1])


def test_stop_string_absent_changes_nothing(fafo_engine):
    plain = fafo_engine.complete(REPEATS, max_tokens=30)
    stopped = fafo_engine.complete(REPEATS, max_tokens=30, stop=["\x00never"])
    assert (stopped.text, stopped.token_ids, stopped.finish_reason) == (plain.text, plain.token_ids, "length")


def _turns(engine, opening: str, follow_up: str, tokens: int = 24):
    first = [{"role": "user", "content": opening}]
    answer = engine.complete(first, max_tokens=tokens)
    return first + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": follow_up}]


@pytest.mark.parametrize("method", ["vanilla", "fafo"])
def test_clients_taking_turns_each_reuse_their_cache(tiny, method):
    engine = load(str(tiny), dtype="float32", method=method)
    engine.keep_conversations(4, 100)
    alone = load(str(tiny), dtype="float32", method=method)  # no kept conversations: the cache follows the last
    a = _turns(engine, "Tell me about the sea, please.", "And the mountains?")
    _turns(alone, "Tell me about the sea, please.", "And the mountains?")
    b = _turns(engine, "What is a prime number?", "Give one more.")
    _turns(alone, "What is a prime number?", "Give one more.")
    a_ids, b_ids = engine.encode(a), engine.encode(b)
    second_a = engine.complete(a, max_tokens=20)
    # A's first turn comes back from the kept copy (its answer as far as the text re-encodes to the same tokens:
    # a random model's bytes often do not)
    assert second_a.stats.cached_prompt_tokens >= len(engine.encode(a[:1]))
    assert alone.complete(a, max_tokens=20).stats.cached_prompt_tokens < 20  # only the template's first tokens
    assert second_a.token_ids == hf_greedy(tiny, a_ids, 20)
    second_b = engine.complete(b, max_tokens=20)  # B was kept when A came back
    assert second_b.stats.cached_prompt_tokens >= len(engine.encode(b[:1]))
    assert second_b.token_ids == hf_greedy(tiny, b_ids, 20)
    assert len(engine.session.kept) == 1  # A (B is live); A's first turn was dropped as a prefix of A's second


def test_kept_conversations_are_bounded_by_count_and_bytes():
    def entry(ids, positions):
        return KeptConversation(ids, torch.zeros(2, positions, 1, 4), torch.zeros(2, positions, 1, 4), {})

    kept = KeptConversations(count=2, max_bytes=10_000)
    one, two, three = entry([1, 2, 3], 10), entry([4, 5], 10), entry([6], 10)
    for conversation in (one, two, three):
        kept.keep(conversation)
    assert kept.entries == [two, three]  # the least recently used went first
    assert kept.best([4, 5, 9]) == (two, 2) and kept.best([7]) == (None, 0)
    kept.keep(entry([1], 200))  # 2 × 6,400 bytes alone exceed the bound: not kept
    assert kept.entries == [two, three]
    big = entry([8], 150)  # 9,600 bytes: everything else is dropped to fit it
    kept.keep(big)
    assert kept.entries == [big] and kept.nbytes <= 10_000
    longer = entry([8, 9], 5)
    kept.keep(longer)  # [8] is a prefix of it: whatever [8] serves, [8, 9] serves too
    assert kept.entries == [longer]


def test_a_conversation_too_large_to_keep_is_not_copied(tiny, monkeypatch):
    """Past --conversations-mb a conversation can never be kept: it was copied all the same (GBs at long contexts,
    on the GPU where the model is) and thrown away, its decoders' state with it."""
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    session = engine.session
    engine.complete("the first conversation, long enough to be kept", max_tokens=30)
    keys, values = session.cache.snapshot(engine.model.dtype)  # the size check is the copy's own size
    assert session.cache.snapshot_bytes(engine.model.dtype) == keys.nbytes + values.nbytes
    session.keep_conversations(2, keys.nbytes + values.nbytes - 1)
    session.carry = carry = {"decoder": "state"}
    monkeypatch.setattr(session.cache, "snapshot", lambda dtype: pytest.fail("copied"))
    engine.complete("another one entirely", max_tokens=4)
    assert len(session.kept) == 0 and session.carry is carry  # (as where no conversation is kept at all)


def test_kept_copy_is_restored_bit_for_bit_in_bfloat16(tiny):
    engine = load(str(tiny), dtype="bfloat16", method="vanilla", chat_template=False)
    engine.keep_conversations(2, 100)
    session = engine.session
    engine.complete("the first conversation, long enough to be kept", max_tokens=30)
    length = session.cache.length
    keys = session.cache.keys[:, :length].clone()
    values = session.cache.values[:, :length].clone()
    ids = list(session.ids)
    engine.complete("another one entirely", max_tokens=30)
    assert len(session.kept) == 1 and not torch.equal(session.cache.keys[:, :8], keys[:, :8])
    session.recall(ids + [0])  # a request continuing the first conversation brings it back
    assert session.ids == ids and session.cache.length == length
    assert torch.equal(session.cache.keys[:, :length], keys) and torch.equal(session.cache.values[:, :length], values)


def test_running_out_of_memory_while_a_kept_copy_loads_leaves_a_consistent_cache(tiny, monkeypatch):
    """A kept copy that cannot be loaded (out of memory while the cache grows for it): that request fails, and the
    next is answered exactly, not from a cache emptied under the ids it held, from the copy still kept."""
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    engine.keep_conversations(2, 100)
    first = "the first conversation, long enough to be kept " * 8
    answer = engine.complete(first, max_tokens=30)
    engine.complete("another one entirely", max_tokens=4)
    cache = engine.session.cache

    def no_memory(positions):
        raise torch.OutOfMemoryError("out of memory")

    again = first + answer.text + " and then"
    monkeypatch.setattr(cache, "reserve", no_memory)  # as when the cache grows to load the kept copy
    with pytest.raises(torch.OutOfMemoryError):
        engine.complete(again, max_tokens=8)
    monkeypatch.undo()
    assert len(engine.session.ids) == cache.length
    result = engine.complete(again, max_tokens=8)
    assert result.token_ids == hf_greedy(tiny, engine.encode(again), 8)
    assert result.stats.cached_prompt_tokens >= len(engine.encode(first))  # the kept copy was not lost


def test_no_room_to_copy_a_conversation_drops_the_kept_ones_and_answers(tiny, monkeypatch):
    """A GPU's memory full: the copy of the conversation a request cuts cannot be made. Every later request would
    run out the same way: the request is answered without keeping it, and the kept ones give their room back."""
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    engine.keep_conversations(4, 100)
    session = engine.session
    engine.complete("the first conversation, long enough to be kept", max_tokens=30)
    engine.complete("a second conversation, long enough to be kept too", max_tokens=30)
    assert len(session.kept) == 1

    def no_memory(dtype):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(session.cache, "snapshot", no_memory)
    prompt = "another one entirely"
    result = engine.complete(prompt, max_tokens=6)
    assert result.token_ids == hf_greedy(tiny, engine.encode(prompt), 6) and len(session.kept) == 0


def test_reset_forgets_kept_conversations(tiny):
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    engine.keep_conversations(2, 100)
    engine.complete("the first conversation, long enough to be kept", max_tokens=30)
    engine.complete("another one entirely", max_tokens=4)
    assert len(engine.session.kept) == 1
    engine.reset()
    assert len(engine.session.kept) == 0 and engine.session.ids == []


@pytest.mark.parametrize("method", ["vanilla", "fafo"])
def test_a_stop_string_that_is_a_special_tokens_text_stops_at_that_token(tiny, method):
    """The shown text never holds a special token, so `stop: ["<|im_start|>"]` (a client whose template ends turns
    with it) is that token's id, not a string that could never match."""
    engine = load(str(tiny), dtype="float32", chat_template=False, method=method)
    full = engine.complete(LONG, max_tokens=256).token_ids
    decode = engine.tokenizer.decode
    # the random model writes a special token now and then (one that decodes to nothing but its own text)
    at = next(i for i, token in enumerate(full) if not decode([token], skip_special_tokens=True))
    text = decode([full[at]], skip_special_tokens=False)
    assert text.startswith("<|") and text not in decode(full, skip_special_tokens=True)
    result = engine.complete(LONG, max_tokens=256, stop=[text, "never"])
    assert result.token_ids == full[:at + 1] and result.finish_reason == "stop"


def test_kept_conversations_make_room_before_a_copy_is_made(tiny, monkeypatch):
    """The kept ones that keeping a conversation drops are dropped before its copy is made: the copies in memory
    never pass the bound, not twice it while a client's conversation is switched for another's."""
    engine = load(str(tiny), dtype="float32", method="vanilla", chat_template=False)
    session = engine.session
    engine.complete("the first conversation, long enough to be kept", max_tokens=30)
    size = session.cache.snapshot_bytes(engine.model.dtype)
    session.keep_conversations(4, 1.5 * size)  # room for one such copy
    engine.complete("another one entirely, as long as the first", max_tokens=30)
    assert len(session.kept) == 1
    copy = session.cache.snapshot
    held = []

    def snapshot(dtype):
        held.append(session.kept.nbytes)
        return copy(dtype)

    monkeypatch.setattr(session.cache, "snapshot", snapshot)
    engine.complete("a third one, as long again as the others", max_tokens=30)
    assert held == [0] and len(session.kept) == 1  # the first dropped before the second was copied

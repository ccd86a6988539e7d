"""Incremental detokenization: exact text reconstruction, multi-byte characters, stop strings, hold-back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from specgate.engine.detokenizer import IncrementalDetokenizer
from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from tests.conftest import build_tokenizer

TOKENIZER = build_tokenizer()


def ids(text: str) -> list[int]:
    out = TOKENIZER.encode(text, add_special_tokens=False)
    assert len(out) == len(text)
    return out


class ByteTokenizer:
    """One token per UTF-8 byte: a character may be split over several tokens."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class PieceTokenizer:
    """SentencePiece-like: '▁' marks a space, and decoding drops the space at the start of the text."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.pieces = list(pieces)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = "".join(self.pieces[i] for i in token_ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def stream(detok: IncrementalDetokenizer, token_ids: Sequence[int]) -> tuple[list[str], str | None, int]:
    """Feed tokens as the engine does; return the streamed chunks (final one last), the stop string and
    the index of the token that completed it (-1 if none)."""
    chunks: list[str] = []
    for i, tok in enumerate(token_ids):
        stop = detok.append(tok)
        if stop is not None:
            chunks.append(detok.take(finished=True))
            return chunks, stop, i
        chunks.append(detok.take(finished=False))
    chunks.append(detok.take(finished=True))
    return chunks, None, -1


def assert_prefix_streaming(chunks: list[str], final: str) -> None:
    """Every streamed prefix is a prefix of the final text, and the chunks add up to it."""
    acc = ""
    for chunk in chunks:
        acc += chunk
        assert final.startswith(acc), f"streamed {acc!r}, which is not a prefix of the final {final!r}"
    assert acc == final


# ---- reconstruction -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["Hello, world!", " leading and trailing spaces  ", "a", "x = {'k': [1, 2]} # ~`|\\", "  "]
)
def test_token_by_token_reconstructs_exact_text(text: str) -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("The prompt: "))
    chunks, stop, _ = stream(detok, ids(text))
    assert stop is None
    assert "".join(chunks) == text
    assert detok.text == text
    # Without stop strings nothing is held back: each token's text is emitted at once.
    assert chunks[:-1] == list(text) and chunks[-1] == ""


def test_reconstruction_with_short_and_empty_prompt() -> None:
    for prompt in ([], ids("a")):
        detok = IncrementalDetokenizer(TOKENIZER, prompt)
        assert "".join(stream(detok, ids("some output"))[0]) == "some output"


def test_special_tokens_are_skipped() -> None:
    eos = TOKENIZER.eos_token_id
    detok = IncrementalDetokenizer(TOKENIZER, ids("p"))
    chunks, _, _ = stream(detok, [*ids("ab"), eos, *ids("c")])
    assert "".join(chunks) == "abc"


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂 and 🎉!", "€ß", "🙂🙂"])
def test_multibyte_characters_are_emitted_only_when_complete(text: str) -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), byte_ids("prompt "))
    chunks, stop, _ = stream(detok, byte_ids(text))
    assert stop is None
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    # A chunk is empty while a character is incomplete, then carries the whole character.
    for chunk in chunks:
        assert len(chunk) <= 1
    assert [c for c in chunks if c] == list(text)


def test_multibyte_character_split_across_two_tokens() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), byte_ids("x"))
    first, second = "é".encode()
    assert detok.append(first) is None
    assert detok.take(finished=False) == ""
    assert detok.text == ""
    assert detok.append(second) is None
    assert detok.take(finished=False) == "é"


def test_multibyte_prompt_context_does_not_leak_into_output() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), byte_ids("préfixe 🙂"))
    assert "".join(stream(detok, byte_ids("ça"))[0]) == "ça"


# ---- leading space --------------------------------------------------------------------------


def test_first_output_token_keeps_its_leading_space() -> None:
    tok = PieceTokenizer(["▁Hello", "▁world", "!", "▁how"])
    assert tok.decode([1]) == "world"  # decoded alone, the space would be lost
    detok = IncrementalDetokenizer(tok, [0])
    chunks, _, _ = stream(detok, [1, 2, 3])
    assert "".join(chunks) == " world! how"
    assert chunks[0] == " world"


def test_first_output_token_keeps_its_leading_space_with_byte_level_tokenizer() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("Hello"))
    assert "".join(stream(detok, ids(" world"))[0]) == " world"


def test_prompt_context_is_limited_to_a_few_tokens() -> None:
    # A long prompt must not be decoded whole on every step: only the last few prompt tokens are kept.
    calls: list[int] = []

    class Counting(ByteTokenizer):
        def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    detok = IncrementalDetokenizer(Counting(), byte_ids("x" * 10_000))
    assert "".join(stream(detok, byte_ids("abc"))[0]) == "abc"
    assert max(calls) < 50


# ---- stop strings ---------------------------------------------------------------------------


def test_stop_string_is_returned_on_the_completing_token_and_cut() -> None:
    text = "Hello world, stop here"
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["stop"])
    chunks, stop, at = stream(detok, ids(text))
    assert stop == "stop"
    assert at == text.index("stop") + len("stop") - 1
    assert detok.text == "Hello world, "
    assert_prefix_streaming(chunks, "Hello world, ")


def test_stop_string_included_when_asked() -> None:
    text = "Hello world, stop here"
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["stop"], include_stop_str_in_output=True)
    chunks, stop, _ = stream(detok, ids(text))
    assert stop == "stop"
    assert detok.text == "Hello world, stop"
    assert_prefix_streaming(chunks, "Hello world, stop")


def test_stop_string_at_the_very_start_of_the_output() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("prompt"), stop=["##"])
    chunks, stop, at = stream(detok, ids("## tail"))
    assert (stop, at) == ("##", 1)
    assert "".join(chunks) == "" and detok.text == ""


def test_stop_string_in_the_prompt_does_not_stop() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("END: "), stop=["END"])
    chunks, stop, _ = stream(detok, ids("all good"))
    assert stop is None and "".join(chunks) == "all good"


def test_stop_string_straddling_prompt_and_output_does_not_stop() -> None:
    # The prompt ends in "EN"; the output starts with "D". Only output text may match.
    detok = IncrementalDetokenizer(TOKENIZER, ids("say EN"), stop=["END"])
    chunks, stop, _ = stream(detok, ids("D ok"))
    assert stop is None and "".join(chunks) == "D ok"


@pytest.mark.parametrize("stops", [("lo wor", "wor"), ("wor", "lo wor")])
def test_earliest_stop_string_wins(stops: tuple[str, str]) -> None:
    # Both complete on the same token ('r'); "lo wor" starts earlier.
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=stops)
    chunks, stop, _ = stream(detok, ids("Hello world"))
    assert stop == "lo wor"
    assert detok.text == "Hel"
    assert_prefix_streaming(chunks, "Hel")


@pytest.mark.parametrize("stops", [("cd", "bc"), ("bc", "cd")])
def test_earliest_stop_string_wins_inside_one_multi_character_token(stops: tuple[str, str]) -> None:
    tok = PieceTokenizer(["▁go", "▁abcde", "▁more"])
    detok = IncrementalDetokenizer(tok, [0], stop=stops)
    chunks, stop, at = stream(detok, [1, 2])
    assert (stop, at) == ("bc", 0)
    assert detok.text == " a"
    assert_prefix_streaming(chunks, " a")


def test_first_completed_stop_string_wins_over_a_longer_one_completing_later() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["abcd", "bc"])
    _, stop, at = stream(detok, ids("xabcdy"))
    assert (stop, at) == ("bc", 3)
    assert detok.text == "xa"


def test_stop_string_spanning_several_multi_character_tokens() -> None:
    tok = PieceTokenizer(["▁q", "▁we", "▁st", "op", "ping▁now"])
    detok = IncrementalDetokenizer(tok, [0], stop=["stopping"])
    chunks, stop, at = stream(detok, [1, 2, 3, 4])
    assert (stop, at) == ("stopping", 3)
    assert detok.text == " we "
    assert_prefix_streaming(chunks, " we ")


def test_stop_string_with_multibyte_characters() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), byte_ids("q"), stop=["é!"])
    chunks, stop, _ = stream(detok, byte_ids("café! après"))
    assert stop == "é!"
    assert detok.text == "caf"
    assert_prefix_streaming(chunks, "caf")


def test_stop_string_repeated_later_is_found_once() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["||"])
    _, stop, at = stream(detok, ids("one|two||three||"))
    assert (stop, at) == ("||", 8)
    assert detok.text == "one|two"


def test_stop_strings_ignored_with_check_stop_false_stay_in_the_text() -> None:
    text = "a##b##c"
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["##"])
    streamed = ""
    for i, tok in enumerate(ids(text)):
        check = i >= 4  # as before min_tokens: the first "##" must not stop
        stop = detok.append(tok, check)
        if stop is not None:
            assert (stop, i) == ("##", 5)
            break
        streamed += detok.take(finished=False)
    streamed += detok.take(finished=True)
    assert detok.text == "a##b" and streamed == "a##b"


def test_stop_string_begun_before_checking_and_completed_after_is_found() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["xyz"])
    assert detok.append(ids("x")[0], False) is None
    assert detok.append(ids("y")[0], False) is None
    assert detok.append(ids("z")[0], True) == "xyz"
    assert detok.text == ""


# ---- hold-back ------------------------------------------------------------------------------


def test_streamed_text_never_contains_a_prefix_of_a_completing_stop_string() -> None:
    text = "abc STOP def"
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["STOP"])
    chunks, stop, _ = stream(detok, ids(text))
    assert stop == "STOP"
    assert_prefix_streaming(chunks, "abc ")
    assert all("S" not in c for c in chunks)


def test_streaming_never_shows_text_later_cut_by_any_of_several_stop_strings() -> None:
    stops = ["<|end|>", "||User:", "###"]
    body = "Sure. <|en then ## and ||Use it. "
    for stop_str in stops:
        detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=stops)
        chunks, stop, _ = stream(detok, ids(body + stop_str + " trailing"))
        assert stop == stop_str
        assert detok.text == body
        assert_prefix_streaming(chunks, body)


def test_held_back_text_that_is_not_a_stop_string_is_emitted() -> None:
    text = "xx ST and more text"
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["STOP"])
    streamed = ""
    for i, tok in enumerate(ids(text)):
        assert detok.append(tok) is None
        streamed += detok.take(finished=False)
        # Hold-back is at most len("STOP") - 1 characters.
        assert len(streamed) >= i + 1 - 3
        assert text.startswith(streamed)
    assert "ST" in streamed  # released before the end, once it could no longer become "STOP"
    streamed += detok.take(finished=True)
    assert streamed == text
    assert detok.take(finished=True) == ""


def test_held_back_tail_is_released_when_finished() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["STOP"])
    for tok in ids("ok STO"):
        assert detok.append(tok) is None
    assert detok.take(finished=False) == "ok "
    assert detok.take(finished=True) == "STO"


def test_take_is_idempotent_between_appends() -> None:
    detok = IncrementalDetokenizer(TOKENIZER, ids("> "), stop=["zz"])
    for tok in ids("abc"):
        detok.append(tok)
    first = detok.take(finished=False)
    assert first == "ab"
    assert detok.take(finished=False) == ""
    assert detok.take(finished=True) == "c"
    assert detok.take(finished=True) == ""


# ---- the engine's use of stop strings -------------------------------------------------------


def test_engine_stop_string_before_min_tokens_is_not_cut_from_the_text(
    make_engine: Callable[..., Engine],
) -> None:
    """Before min_tokens a stop string does not end the request (as in vLLM), so it must stay in the text."""
    engine = make_engine()
    prompt = [40, 41, 42, 43, 44]

    def run(rid: str, params: SamplingParams) -> tuple[list[int], str]:
        engine.add_request(rid, prompt, params)
        tokens: list[int] = []
        text = ""
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                text += out.new_text
        return tokens, text

    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=12)
    tokens, text = run("plain", SamplingParams(**greedy))
    assert len(text) == 12
    stop = text[2:4]
    tokens2, text2 = run("min", SamplingParams(**greedy, stop=[stop], min_tokens=12))
    assert tokens2 == tokens  # the request correctly ran on past the stop string...
    assert text2.startswith(text[:4]), f"stop {stop!r} was cut out of the text: {text2!r} vs {text!r}"

"""IncrementalDetokenizer on the real SmolLM2 (byte-level BPE) and Gemma 3 (byte fallback)
tokenizers: split UTF-8 characters, stop strings across tokens, special tokens, context, cost."""

from __future__ import annotations

import copy

import pytest

from infer.detokenizer import IncrementalDetokenizer

# Text whose characters are split across tokens: CJK, emoji with a skin-tone modifier, a ZWJ
# family, flags, accents. The last one forces Gemma's byte-fallback tokens (<0xF0><0x93>...).
UTF8_TEXTS = [
    "日本語のテキストと中文文本。",
    "Hi 👋🏽 there 👨‍👩‍👧 🇫🇷!",
    "Café naïve Ærøskøbing — “quotes” déjà vu",
    "𓀀𓀁 𠜎𠜱 ꙮ ᚠᛇᚻ 𐌰𐌱 🫨🪿",
]
PROMPT = "Write something:"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tok(request):
    return request.getfixturevalue(request.param).tokenizer


def stream(tok, ids, prompt_ids=None, chunk=1, **kw):
    """Feed ``ids`` ``chunk`` at a time; return (detokenizer, deltas incl. finish's)."""
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT) if prompt_ids is None else prompt_ids, **kw)
    deltas = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(d.finish())
    return d, deltas


# ------------------------------------------------------------------ UTF-8 splits


@pytest.mark.parametrize("text", UTF8_TEXTS)
def test_split_characters_never_stream_replacement_char(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == text
    d, deltas = stream(tok, ids)
    assert not any("\ufffd" in x for x in deltas), deltas
    assert "".join(deltas) == full == d.output_text
    assert d.stop_reason is None and d.token_ids == ids


def test_the_texts_really_split_characters(tok):
    # Otherwise the test above would prove nothing: some token must decode to U+FFFD alone.
    ids = tok.encode("".join(UTF8_TEXTS), add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 5


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_tokens_per_add(tok, chunk):
    text = " ".join(UTF8_TEXTS)
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas = stream(tok, ids, chunk=chunk)
    assert not any("\ufffd" in x for x in deltas)
    assert d.output_text == tok.decode(ids)


def test_invalid_bytes_are_emitted_and_do_not_grow_the_window(tok):
    # A model can emit byte tokens that never form UTF-8; the window must not grow forever.
    byte_tok = tok.token_to_id("<0x80>") if tok.token_to_id("<0x80>") is not None else tok.token_to_id("Ģ")
    assert byte_tok is not None
    lengths, counting = counting_tokenizer(tok)
    ids = [byte_tok] * 60 + tok.encode(" ok 日本", add_special_tokens=False)
    d, _ = stream(counting, ids)
    assert max(lengths) <= 20  # two windows of at most 9 pending tokens, whatever the length
    assert d.output_text.endswith(" ok 日本")
    assert d.output_text.count("\ufffd") == tok.decode(ids).count("\ufffd")


# ------------------------------------------------------------------ stop strings


def _check_stop(tok, text, stop, include=False, expect_cut=True):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    cut = full.find(stop)
    assert (cut != -1) == expect_cut
    expected = full if cut == -1 else full[: cut + (len(stop) if include else 0)]
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=[stop], include_stop_str_in_output=include)
    for t in ids:
        d.add([t])
        # Every streamed prefix is a prefix of the final text: nothing of the stop string (nor
        # anything after it) is ever streamed, and nothing streamed is taken back.
        assert expected.startswith(d.output_text), (d.output_text, expected)
    d.finish()
    assert d.output_text == expected
    assert d.stop_reason == (stop if cut != -1 else None)
    return d, ids


def _tokens_spanned(tok, ids, start, end):
    """How many tokens overlap the characters [start, end) of decode(ids)."""
    n, pos = 0, 0
    for k in range(1, len(ids) + 1):
        new_pos = len(tok.decode(ids[:k]))
        if new_pos > start and pos < end:
            n += 1
        pos = new_pos
    return n


STOP_CASES = [
    # (text, stop): the stop string spans several tokens on both tokenizers.
    ("The answer is 42.\n\nUser: and now?\n\nUser: again", "\n\nUser:"),
    ("Use the force. User manual: see page 3. END_OF_ANSWER and more text", "END_OF_ANSWER"),
    ("日本語のテキスト。終わり。その後の文", "り。その"),
    ("runes ᚠᛇᚻ then more", "ᛇᚻ"),
]


@pytest.mark.parametrize("text,stop", STOP_CASES)
def test_stop_string_across_tokens_is_never_partially_streamed(tok, text, stop):
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    cut = full.find(stop)
    assert _tokens_spanned(tok, ids, cut, cut + len(stop)) >= 2
    d, _ = _check_stop(tok, text, stop)
    # generation stops at the token that completed the stop string; later ids are ignored
    assert len(d.token_ids) < len(ids)
    assert stop in tok.decode(d.token_ids) and stop not in tok.decode(d.token_ids[:-1])
    assert d.add(ids) == "" and d.finished


@pytest.mark.parametrize("text,stop", STOP_CASES)
def test_include_stop_str_in_output(tok, text, stop):
    d, _ = _check_stop(tok, text, stop, include=True)
    assert d.output_text.endswith(stop)


def test_partial_stop_prefix_is_held_then_released(tok):
    # "\n\nUse the" starts like the stop string "\n\nUser:" but is not it: it is held while it
    # could be, then released; at the real occurrence the text is cut.
    text = "Fine.\n\nUse the force.\n\nUser: next"
    stop = "\n\nUser:"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=[stop])
    held_something = False
    for k, t in enumerate(ids):
        d.add([t])
        if d.stop_reason:
            break
        # Exactly the longest suffix that could still grow into the stop string is held back.
        decoded = tok.decode(ids[: k + 1])
        hold = max((n for n in range(1, len(stop)) if decoded.endswith(stop[:n])), default=0)
        assert d.output_text == decoded[: len(decoded) - hold]
        held_something |= decoded.endswith("\n\nUse")
    assert held_something
    assert d.output_text == "Fine.\n\nUse the force."
    assert d.stop_reason == stop


def test_held_back_text_is_released_by_finish(tok):
    text = "It ends with\n\nUs"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode(PROMPT), stop=["\n\nUser:"])
    d.add(ids)
    assert d.output_text == "It ends with"
    assert d.finish() == "\n\nUs"
    assert d.output_text == tok.decode(ids) and d.stop_reason is None
    assert d.finish() == ""
    with pytest.raises(RuntimeError):
        d.add(ids)


def test_earliest_of_several_stop_strings_wins(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False)
    d, _ = stream(tok, ids, stop=["delta", " gam", "beta gamma"])
    assert d.output_text == "alpha " and d.stop_reason == "beta gamma"


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=[""])


# ------------------------------------------------------------------ special tokens, context


def test_skip_special_tokens(smollm2):
    tok = smollm2.tokenizer
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.all_special_ids
    ids = tok.encode("Hello there", False) + [im_end] + tok.encode("\nMore text 日本", False)
    for skip in (True, False):
        d, deltas = stream(tok, ids, skip_special_tokens=skip)
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in d.output_text) is (not skip)
        assert not any("\ufffd" in x for x in deltas)


def test_special_tokens_in_prompt_context(smollm2):
    # A ChatML prompt ends with "<|im_start|>assistant\n": the context skips the specials.
    tok = smollm2.tokenizer
    prompt = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False)
    ids = tok.encode("Hello! How can I help?", False)
    for skip in (True, False):
        d, _ = stream(tok, ids, prompt_ids=prompt, skip_special_tokens=skip)
        assert d.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_leading_space_of_first_token_is_kept(tok):
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris, of course.", add_special_tokens=False)
    assert tok.decode(ids[:1]).startswith(" ")
    d, deltas = stream(tok, ids, prompt_ids=prompt)
    first = next(x for x in deltas if x)
    assert first.startswith(" Paris")
    assert d.output_text == " Paris, of course." == tok.decode(ids)


def test_empty_prompt(tok):
    ids = tok.encode("no context 日本", add_special_tokens=False)
    d, _ = stream(tok, ids, prompt_ids=[])
    assert d.output_text == tok.decode(ids)


# ------------------------------------------------------------------ cost


class _CountingBackend:
    """A thin wrapper around tokenizers.Tokenizer that records the length of each decode."""

    def __init__(self, inner, lengths):
        self._inner, self._lengths = inner, lengths

    def decode(self, ids, skip_special_tokens=True):
        self._lengths.append(len(ids))
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def counting_tokenizer(tok):
    lengths: list[int] = []
    wrapped = copy.copy(tok)
    wrapped.backend = _CountingBackend(tok.backend, lengths)
    return lengths, wrapped


def test_work_per_token_is_bounded(tok):
    paragraph = "Streaming text, token by token: 日本語のテキスト 👋🏽 café. "
    ids: list[int] = []
    while len(ids) < 500:
        ids += tok.encode(paragraph, add_special_tokens=False)
    ids = ids[:500]
    lengths, counting = counting_tokenizer(tok)
    d, _ = stream(counting, ids, stop=["never appears"])
    assert d.output_text == tok.decode(ids)
    # Two short decodes per token at most; the window never grows with the sequence.
    assert len(lengths) <= 2 * len(ids) + 2
    assert max(lengths) <= 12, max(lengths)
    assert sum(lengths) <= 8 * len(ids)


# ------------------------------------------------------------------ the memo of one-token texts


class _NoMemo:
    """The same tokenizer without ``decode_token``: every window is decoded by ``decode``."""

    def __init__(self, tok):
        self._tok, self.all_special_ids = tok, tok.all_special_ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_token_is_decode_of_one_id(tok):
    import random

    rng = random.Random(0)
    ids = rng.sample(range(tok.vocab_size), 300) + sorted(tok.all_special_ids)
    for skip in (True, False):
        for i in ids + ids:  # the second pass reads the memo
            assert tok.decode_token(i, skip) == tok.decode([i], skip_special_tokens=skip)


def test_memoized_windows_stream_the_same_text(tok):
    # Random ids (byte fragments, special tokens, invalid UTF-8 included) and real text: the
    # deltas with the memo equal those of plain decode calls, one by one.
    import random

    rng = random.Random(1)
    text_ids = tok.encode(" ".join(UTF8_TEXTS), add_special_tokens=False)
    for ids in (text_ids, [rng.randrange(tok.vocab_size) for _ in range(400)]):
        for kw in ({}, {"skip_special_tokens": False}, {"stop": ["xyz", "\n\n"]}):
            _, memo = stream(tok, ids, **kw)
            _, plain = stream(_NoMemo(tok), ids, prompt_ids=tok.encode(PROMPT), **kw)
            assert memo == plain


def test_add_token_streams_what_add_streams(tok):
    # The engine's one-token call inlines the usual step; every delta, the final text, the ids
    # and the stop reason must be add()'s, for real text (split characters), random ids (byte
    # fragments, invalid UTF-8, special tokens), stop strings that cut and hold text back, and
    # the memo-less tokenizer (add_token then takes add's path).
    import random

    rng = random.Random(2)
    text_ids = tok.encode(" ".join(UTF8_TEXTS) + " the end. " * 80, add_special_tokens=False)
    random_ids = [rng.randrange(tok.vocab_size) for _ in range(700)]  # past the window's compaction
    cases = [({}, tok), ({"skip_special_tokens": False}, tok), ({"stop": ["xyz", "\n\n", "end."]}, tok),
             ({"stop": ["水"], "include_stop_str_in_output": True}, tok), ({}, _NoMemo(tok))]
    for ids in (text_ids, random_ids, sorted(tok.all_special_ids) + text_ids[:50]):
        for kw, t in cases:
            ref, ref_deltas = stream(t, ids, prompt_ids=tok.encode(PROMPT), **kw)
            d = IncrementalDetokenizer(t, tok.encode(PROMPT), **kw)
            deltas = [d.add_token(i) for i in ids] + [d.finish()]
            assert deltas == ref_deltas
            assert (d.output_text, d.token_ids, d.stop_reason) == (ref.output_text, ref.token_ids, ref.stop_reason)

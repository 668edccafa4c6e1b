"""Rebuilding a ``tokenizers.Tokenizer`` from a GGUF's vocabulary.

A GGUF has no ``tokenizer.json``; llama.cpp stores the vocabulary as metadata
(``tokenizer.ggml.tokens``, ``.token_type``, ``.merges``, ``.scores``) and names the
algorithm in ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen). Tokens are spelled in GPT-2's
  byte-to-unicode alphabet and the merges are stored. The pre-tokenizer regex is named by
  ``tokenizer.ggml.pre``; we follow llama.cpp's table for the names we know.
* ``llama``: SentencePiece-style BPE with byte fallback (Gemma). No merges are stored: they
  are recovered from the vocabulary (every token that splits into two tokens gives a merge),
  ranked by the token's position in the file, which is Gemma's merge order.

Token types: 3 (control) become special added tokens, 4 (user-defined) plain added tokens,
so both are matched whole in text, as llama.cpp does.

Building Gemma's 262k-token vocabulary takes a few seconds, so the result is cached as a
``tokenizer.json`` (:func:`infer.loader.gguf.cached_path`).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from infer.errors import ModelLoadError
from infer.tokenizer import bytes_to_unicode

CONTROL, USER_DEFINED = 3, 4

# llama.cpp's pre-tokenizer regexes for the byte-level vocabularies we know (llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split digits one by one first?, main regex)
_PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT),
    "gpt-2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),  # SmolLM2: digits split individually, then GPT-2's regex
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-v3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}


def _add_special(tk: Tokenizer, tokens: list[str], types: list[int], keep=lambda t: True,
                 user_normalized: bool = False) -> None:
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty == CONTROL and keep(t)
    ]
    user = [
        AddedToken(t, special=False, normalized=user_normalized)
        for t, ty in zip(tokens, types)
        if ty == USER_DEFINED and keep(t)
    ]
    if control:
        tk.add_special_tokens(control)
    if user:
        tk.add_tokens(user)


def byte_level_bpe(meta: dict[str, Any], source: str) -> Tokenizer:
    """``tokenizer.ggml.model == "gpt2"``."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError(source, "byte-level BPE vocabulary without tokenizer.ggml.merges")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            source, f"unknown pre-tokenizer {pre!r} (known: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    digits, regex = _PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    alphabet = set(bytes_to_unicode().values())
    # A control token spelled outside the byte alphabet is a converter mislabel: skip it.
    _add_special(tk, tokens, meta.get("tokenizer.ggml.token_type") or [], keep=lambda t: set(t) <= alphabet
                 or t.startswith("<"))
    return tk


def sentencepiece_bpe(meta: dict[str, Any], source: str) -> Tokenizer:
    """``tokenizer.ggml.model == "llama"`` (SentencePiece BPE, byte fallback)."""
    tokens = [
        "\u2581" * len(t) if (" " in t and not t.strip(" ")) else t  # Gemma stores "  " for "▁▁"
        for t in meta["tokenizer.ggml.tokens"]
    ]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        merge_pairs = _merges_from_vocab(tokens, types)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tk = Tokenizer(
        models.BPE(
            vocab,
            merge_pairs,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        tk.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        tk.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    # User-defined pieces (Gemma's runs of spaces, "▁▁"...) are matched whole in the *normalized*
    # text, where spaces are already "▁", as SentencePiece and llama.cpp match them.
    _add_special(tk, tokens, types, user_normalized=True)
    return tk


def _merges_from_vocab(tokens: list[str], types: list[int]) -> list[tuple[str, str]]:
    """Every ``(left, right)`` whose concatenation is a token, ranked by that token's index.

    A merge can only be learned after both its halves exist, and a BPE vocabulary lists tokens
    in the order they were learned, so the index of the merged token is its merge rank.
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    ranked: list[tuple[int, int, int, str, str]] = []
    for token, rank in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            li, ri = normal.get(left), normal.get(right)
            if li is not None and ri is not None:
                ranked.append((rank, li, ri, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


BUILDERS = {"gpt2": byte_level_bpe, "llama": sentencepiece_bpe}


def build_tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the vocabulary described by GGUF ``meta``.

    Args:
        meta: GGUF metadata (``tokenizer.ggml.*`` keys) as Python values.
        source: the file, for error messages.

    Raises:
        ModelLoadError: for a missing vocabulary or an unsupported tokenizer model.
    """
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(source, "no tokenizer vocabulary (tokenizer.ggml.tokens) in the metadata")
    if kind not in BUILDERS:
        raise ModelLoadError(
            source, f"unsupported tokenizer model {kind!r} (supported: {', '.join(sorted(BUILDERS))})"
        )
    return BUILDERS[kind](meta, source)

"""The tokenizer: a ``tokenizers.Tokenizer`` plus what the model files say about it.

Text <-> token ids is done entirely by Hugging Face's ``tokenizers`` library (Rust, fast).
This wrapper only adds what a serving engine needs around it: the special ids (BOS, the EOS
set that stops generation), whether a BOS is prepended, and the chat template.

Sources: a model directory's ``tokenizer.json`` + ``tokenizer_config.json`` (+
``chat_template.jinja``, transformers 5's spelling), or a GGUF's metadata
(:mod:`infer.loader.gguf_tokenizer` rebuilds the tokenizer from it).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import tokenizers

from infer.errors import ModelLoadError


class Tokenizer:
    """Encode/decode plus special-token facts.

    Attributes:
        backend: the ``tokenizers.Tokenizer``.
        bos_token_id: id of the beginning-of-sequence token, or None.
        eos_token_ids: every id that ends generation (from generation_config.json, config.json,
            tokenizer_config.json or GGUF metadata; never a hard-coded list).
        add_bos_token: whether :meth:`encode` prepends BOS when ``add_special_tokens``.
        chat_template: the Jinja2 chat template, or None for a base model.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos_token: bool,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        # Does the backend's post-processor already add BOS? Probe once, so encode() adds
        # or removes exactly one BOS, whatever the tokenizer.json says.
        probe = backend.encode("a", add_special_tokens=True).ids
        self._backend_adds_bos = bool(probe) and bos_token_id is not None and probe[0] == bos_token_id
        self.all_special_ids = set(self._special_ids())
        # decode_token's memo: {skip_special_tokens: {token id: text}}
        self._token_text: dict[bool, dict[int, str]] = {True: {}, False: {}}

    def _special_ids(self) -> list[int]:
        ids = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        out = [self.backend.token_to_id(t) for t in ids]
        return [i for i in out if i is not None]

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, BOS first when the model wants one.

        Through the backend's batch call: unlike ``encode``, it releases Python's GIL while the Rust
        tokenizer works, so a long text tokenized on one thread does not stall the others (measured
        on a 1.2M-token text: the other threads' longest stall 4.3 s with ``encode``, 0.07 s here)."""
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the vocabulary's longest token string (added tokens included): no token covers
        more characters of a text than that (:mod:`infer.engine.input_processor` bounds prompts with it)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped when ``skip_special_tokens``)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, memoized: the text of one token decoded alone.

        The incremental detokenizer asks for it once per generated token (the context window of
        the next step is usually the one token just emitted) and logprobs ask for it per
        candidate, so at hundreds of sequences per step the cache saves one call into the Rust
        tokenizer per token. At most one entry per vocabulary id (a few MB for 150k ids).
        """
        cache = self._token_text[skip_special_tokens]
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = self.backend.decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dir(cls, path: str | Path, model_config: dict[str, Any] | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``).

        EOS ids: ``generation_config.json``'s ``eos_token_id`` if present, else
        ``config.json``'s, else the id of ``tokenizer_config.json``'s ``eos_token``.

        Raises:
            ModelLoadError: when ``tokenizer.json`` is missing or unreadable.
        """
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(tj, "file not found (infer needs a fast tokenizer, tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise ModelLoadError(tj, f"not a valid tokenizers file ({e})") from None
        tcfg = _read_json(path / "tokenizer_config.json") or {}
        gen = _read_json(path / "generation_config.json") or {}
        model_config = model_config or {}

        def token_str(v: Any) -> str | None:
            if isinstance(v, dict):  # AddedToken serialized as a dict
                return v.get("content")
            return v

        specials = {k: token_str(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        bos_id = _first_id(gen.get("bos_token_id"), model_config.get("bos_token_id"))
        if bos_id is None and specials["bos_token"]:
            bos_id = backend.token_to_id(specials["bos_token"])
        eos = _as_list(gen.get("eos_token_id")) or _as_list(model_config.get("eos_token_id"))
        if not eos and specials["eos_token"] and backend.token_to_id(specials["eos_token"]) is not None:
            eos = [backend.token_to_id(specials["eos_token"])]
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        add_bos = tcfg.get("add_bos_token")
        if add_bos is None:  # not stated: keep whatever the post-processor does
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bool(probe) and bos_id is not None and probe[0] == bos_id
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos,
            add_bos_token=bool(add_bos),
            chat_template=template,
            special_tokens=specials,
        )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"not valid JSON ({e})") from None


def _as_list(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(v)] if isinstance(v, int) else [int(x) for x in v]


def _first_id(*values: Any) -> int | None:
    for v in values:
        ids = _as_list(v)
        if ids:
            return ids[0]
    return None

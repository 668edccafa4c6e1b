"""Structured output (phase 13): constrain generation to a JSON schema, a regex or a choice list.

A constraint is a regular language. outlines-core (the Rust core of outlines; Willard and Louf
2023, "Efficient Guided Generation for Large Language Models", arXiv:2307.09702) turns a JSON
schema into a regex (:func:`outlines_core.json_schema.build_regex_from_schema`), the regex into
a deterministic automaton over *bytes*, and then walks the automaton with every token of the
vocabulary to build an :class:`outlines_core.Index`: for each automaton state, the tokens that
keep the output inside the language and the state each one leads to. A per-sequence
:class:`outlines_core.Guide` holds the current state; at each step the engine writes the
state's allowed tokens as a packed bitmask (one bit per token, ``int32`` words), the batched
sampler sets the other logits to ``-inf`` (:func:`apply_token_bitmask`), and the sampled token
advances the guide.

Pieces:

* :class:`StructuredOutputsParams`: the request's constraint (vLLM's ``structured_outputs``:
  ``json``, ``regex``, ``choice``, ``json_object``), checked when built and turned into a regex.
* :func:`token_bytes`: the vocabulary as the bytes each token stands for (byte-level BPE tokens
  are mapped back through GPT-2's byte-to-unicode table; SentencePiece ``<0xAB>`` and ``▁`` too).
* :class:`IndexCache`: compiled indexes keyed by (regex, tokenizer) in a bounded LRU, compiled
  in a thread pool so a slow compile never stalls the engine's steps.
* :func:`apply_token_bitmask` / :func:`apply_token_bitmask_reference`: the mask, on the device.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "GuideMasks",
    "IndexCache",
    "StructuredOutputsParams",
    "apply_token_bitmask",
    "apply_token_bitmask_reference",
    "choice_regex",
    "token_bytes",
]

_SCALAR = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]}
#: What an unconstrained JSON value (``{}``, ``true``, the values of ``{"type": "object"}`` or the
#: items of ``{"type": "array"}``) compiles to: a scalar, an array of scalars or an object of
#: scalars. outlines-core's own "any value" nests to any depth and its index takes ~16 s to
#: compile for a 49k vocabulary (the compile-stall trap); this one ~1 s. Outputs still validate.
ANY_VALUE = {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]}
#: ``response_format={"type": "json_object"}``: an object of such values.
JSON_OBJECT_SCHEMA = {"type": "object"}
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly"}


def choice_regex(choices: list[str]) -> str:
    """The regex whose language is exactly ``choices``: each choice matched literally (its regex
    metacharacters escaped), the alternation one group, so that the regex stays one unit inside a
    longer pattern (``choice_regex(["a", "b"]) + "!"`` matches ``a!`` and ``b!`` only).

    Raises:
        ValueError: anything but a non-empty list (or tuple) of non-empty strings: an empty list, an
            empty or non-string choice, a bare string.
    """
    # >>> EXERCISE choice_regex
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("choice must be a non-empty list of strings")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ValueError(f"choice[{i}] must be a non-empty string, got {c!r}")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"
    # <<< EXERCISE choice_regex


@dataclass
class StructuredOutputsParams:
    """A request's output constraint (exactly one field set; vLLM's ``StructuredOutputsParams``).

    Attributes:
        json: a JSON schema (``dict`` or its JSON text): the output is a JSON document that
            validates against it.
        regex: the output fully matches this regular expression (Rust ``regex`` syntax, as
            outlines-core compiles it; no look-around, no back-references).
        choice: the output is exactly one of these strings.
        json_object: the output is some JSON object (OpenAI's ``{"type": "json_object"}``).
        whitespace_pattern: the regex for the whitespace allowed between JSON tokens (outlines'
            default when ``None``).

    Raises:
        ValueError: not exactly one constraint, a schema that is not JSON or uses a feature
            outlines-core cannot compile, an empty choice list. (An uncompilable regex is
            found by :meth:`check`, which also runs the automaton construction.)
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, json_object; got "
                + (", ".join(given) if given else "none"))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"regex must be a string, got {type(self.regex).__name__}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        self._regex: str | None = None
        self.to_regex()  # schema problems are found here, at once

    def to_regex(self) -> str:
        """The regex the output must fully match (computed once).

        Raises:
            ValueError: an invalid or unsupported JSON schema, or a bad choice list.
        """
        if self._regex is not None:
            return self._regex
        if self.regex is not None:
            self._regex = self.regex
        elif self.choice is not None:
            self._regex = choice_regex(self.choice)
        else:
            from outlines_core.json_schema import build_regex_from_schema

            schema = JSON_OBJECT_SCHEMA if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"json schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            _check_schema(schema)
            try:
                schema = lower_schema(schema)
            except (TypeError, AttributeError, OverflowError) as e:  # e.g. a bound that is not a number
                raise ValueError(f"invalid JSON schema: {e}") from None
            try:
                self._regex = build_regex_from_schema(json.dumps(schema), self.whitespace_pattern)
            except Exception as e:  # outlines-core raises ValueError/TypeError for unsupported features
                raise ValueError(f"unsupported or invalid JSON schema: {e}") from None
        return self._regex

    def check(self) -> None:
        """Compile the regex's automaton once on a 2-token vocabulary (fast: no vocabulary walk).

        Raises:
            ValueError: the regex cannot be compiled (syntax, or an unsupported feature).
        """
        from outlines_core import Index, Vocabulary

        try:
            Index(self.to_regex(), Vocabulary(1, {b"a": [0]}))
        except ValueError as e:
            if "incompatible" in str(e):
                return  # the automaton was built; "a" alone cannot walk it: the real vocabulary decides
            raise ValueError(f"cannot compile regex {self.to_regex()[:200]!r}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("json", "regex", "choice", "json_object", "whitespace_pattern")
                if getattr(self, k) not in (None, False)}


def _check_schema(schema: dict) -> None:
    """Reject a schema that is not a valid JSON schema (``jsonschema``'s metaschema check, when the
    library is installed; outlines-core alone accepts some nonsense, e.g. ``{"type": "nope"}``)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"invalid JSON schema: {e.message}") from None


#: Keywords outlines-core 0.2.14 would silently ignore (the output could then violate them):
#: rejected with a clear error instead.
UNSUPPORTED_KEYWORDS = ("multipleOf", "uniqueItems", "minProperties", "maxProperties", "not", "if", "then", "else",
                        "patternProperties", "contains", "propertyNames", "dependentRequired", "dependentSchemas",
                        "unevaluatedProperties", "unevaluatedItems")
#: The widest integer range turned into an enumeration.
MAX_INTEGER_RANGE = 2000


def lower_schema(schema: Any, path: str = "#") -> Any:
    """A copy of ``schema`` that outlines-core compiles faithfully, or a ``ValueError``.

    outlines-core 0.2.14 ignores numeric bounds (``minimum``...) and some other keywords, which
    would let outputs through that do not validate. An integer with both bounds (at most
    :data:`MAX_INTEGER_RANGE` values) becomes the ``enum`` of its values; a bound it cannot
    express (on a ``number``, one-sided, too wide) or a keyword of :data:`UNSUPPORTED_KEYWORDS`
    raises, naming the keyword and where it is.
    """
    if isinstance(schema, list):
        return [lower_schema(s, f"{path}/{i}") for i, s in enumerate(schema)]
    if schema is True:
        return ANY_VALUE
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if not set(out) - _ANNOTATIONS:
        return ANY_VALUE  # any value at all
    if out.get("type") == "object" and not {"properties", "additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = ANY_VALUE
    if out.get("type") == "array" and not {"items", "prefixItems"} & set(out):
        out["items"] = ANY_VALUE
    for k in UNSUPPORTED_KEYWORDS:
        if k in out:
            raise ValueError(f"unsupported JSON schema feature {k!r} at {path}")
    bounds = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in out]
    if bounds:
        if out.get("type") != "integer":
            raise ValueError(f"unsupported JSON schema feature: {', '.join(bounds)} at {path} (bounds are supported on "
                             "integers only)")
        lo = max(out.get("minimum", -float("inf")), out.get("exclusiveMinimum", -float("inf")) + 1)
        hi = min(out.get("maximum", float("inf")), out.get("exclusiveMaximum", float("inf")) - 1)
        if not (-float("inf") < lo and hi < float("inf")) or hi - lo + 1 > MAX_INTEGER_RANGE:
            raise ValueError(f"unsupported JSON schema feature: integer bounds at {path} need both a minimum and a "
                             f"maximum, at most {MAX_INTEGER_RANGE} values apart")
        for k in (*bounds, "type"):
            out.pop(k)
        out["enum"] = list(range(int(math.ceil(lo)), int(math.floor(hi)) + 1))
        if not out["enum"]:
            raise ValueError(f"integer bounds at {path} admit no value")
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: lower_schema(s, f"{path}/{key}/{name}") for name, s in out[key].items()}
    for key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems"):
        if key in out:
            out[key] = lower_schema(out[key], f"{path}/{key}")
    return out


# ----------------------------------------------------------------------------- vocabulary

_SPM_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer) -> dict[int, bytes]:
    """``{token id: the bytes it decodes to}`` for every ordinary (non-special) token.

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) store each byte as a printable
    unicode character (GPT-2's ``bytes_to_unicode`` table): ``"Ġ"`` is the byte 0x20. Those are
    mapped back to bytes here, else the automaton, which walks bytes, would see ``"Ġ"`` as two
    UTF-8 bytes and no JSON would ever get a space. SentencePiece vocabularies (Gemma) use
    ``"▁"`` for a space and ``<0xAB>`` for byte fallback.
    """
    from infer.tokenizer import bytes_to_unicode

    backend = tokenizer.backend
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = json.dumps(decoder)
    byte_level = "ByteLevel" in kinds
    unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out: dict[int, bytes] = {}
    for tok, tid in backend.get_vocab(with_added_tokens=True).items():
        if tid in special:
            continue
        m = _SPM_BYTE.match(tok)
        if m:
            out[tid] = bytes([int(m.group(1), 16)])
        elif byte_level:
            try:
                out[tid] = bytes(unicode_to_byte[c] for c in tok)
            except KeyError:  # an added (non-special) token stored as plain text
                out[tid] = tok.encode()
        else:
            out[tid] = tok.replace("\u2581", " ").encode()
    return out


def build_vocabulary(tokenizer, eos_token_id: int):
    """An :class:`outlines_core.Vocabulary` of ``tokenizer`` (EOS and special tokens left out)."""
    from outlines_core import Vocabulary

    by_bytes: dict[bytes, list[int]] = {}
    for tid, b in token_bytes(tokenizer).items():
        if tid != eos_token_id and b:
            by_bytes.setdefault(b, []).append(tid)
    return Vocabulary(eos_token_id, by_bytes)


# ----------------------------------------------------------------------------- index cache


class IndexCache:
    """Compiled :class:`outlines_core.Index` es by regex, in a bounded LRU, compiled off-thread.

    One cache belongs to one tokenizer (the engine's), so the key ``(regex, tokenizer)`` is the
    regex alone. :meth:`get` returns a :class:`concurrent.futures.Future`: a hit is already done;
    a miss starts the compile in the thread pool (outlines-core releases the GIL while it walks
    the vocabulary), so the engine keeps stepping the other requests while it runs (the traps
    of outlines-core #193 and vLLM #3567: a compile on the engine thread stalls every request).
    Two requests for the same regex share one compile.

    Args:
        tokenizer: the engine's :class:`~infer.tokenizer.Tokenizer`.
        eos_token_id: the EOS id the automaton accepts at its final states.
        max_size: most indexes kept (least recently used evicted first).
        max_workers: compile threads.
    """

    def __init__(self, tokenizer, eos_token_id: int, max_size: int = 64, max_workers: int = 1) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_size = max_size
        self._vocab = None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                                           thread_name_prefix="infer-index")
        self.hits = self.misses = 0

    def vocabulary(self):
        """The tokenizer's :class:`outlines_core.Vocabulary` (built once, on first use)."""
        with self._lock:
            if self._vocab is None:
                self._vocab = build_vocabulary(self.tokenizer, self.eos_token_id)
            return self._vocab

    def _compile(self, regex: str):
        from outlines_core import Index

        return Index(regex, self.vocabulary())

    def get(self, regex: str) -> concurrent.futures.Future:
        """The future of ``regex``'s index (done at once on a hit). A failed compile is not kept."""
        with self._lock:
            fut = self._entries.get(regex)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._entries.move_to_end(regex)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._pool.submit(self._compile, regex)
            self._entries[regex] = fut
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)
            return fut

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------- the mask


@functools.lru_cache(maxsize=8)
def _not_eos_words(eos_token_ids: tuple[int, ...], words: int):
    """uint32 ``[words]``: every bit set but the EOS tokens' (read-only, shared)."""
    import numpy as np

    out = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
    for e in eos_token_ids:
        if 0 <= e < 32 * words:
            out[e // 32] &= np.uint32(~(1 << (e % 32)) & 0xFFFFFFFF)
    out.setflags(write=False)
    return out


class GuideMasks:
    """The packed allowed-token bitmasks of one sequence's recent automaton states.

    outlines-core writes a state's mask (``Guide.write_mask_into``) by walking the state's
    transitions: ~0.1 ms for an open string (tens of thousands of allowed tokens) at Qwen3's
    151,936 ids. A sequence inside a JSON string or number stays in one state for many steps,
    so the masks of its last ``max_states`` states are kept (an LRU keyed by state id), and both
    per-step questions read them:

    * :meth:`mask`: the current state's ``[ceil(V / 32)]`` uint32 words, which the model runner
      copies into the step's bitmask row;
    * :meth:`eos_only`: is EOS the only token the state allows (the constraint is complete, the
      sequence stops)? ``guide.get_tokens()`` answers that too, but builds a Python list of every
      allowed token (~1 ms per step for an open string).

    One per sequence (or per guide's index at least: state ids are an index's own).

    Args:
        eos_token_ids: the ids that count as EOS.
        vocab_size: ``V``, the width of the model's logits.
        max_states: masks kept (``4 ceil(V / 32)`` bytes each: 19 KB at ``V`` = 151,936).
    """

    def __init__(self, eos_token_ids: list[int], vocab_size: int, max_states: int = 8) -> None:
        self.words = -(-vocab_size // 32)
        self.max_states = max_states
        self._not_eos = _not_eos_words(tuple(eos_token_ids), self.words)
        self._masks: OrderedDict[int, Any] = OrderedDict()

    def mask(self, guide: Any):
        """uint32 ``[ceil(V / 32)]`` (a numpy array; do not modify): bit ``v % 32`` of word
        ``v // 32`` is set when ``guide``'s current state allows token ``v``."""
        import numpy as np

        state = guide.get_state()
        m = self._masks.get(state)
        if m is not None:
            self._masks.move_to_end(state)
            return m
        m = np.zeros(self.words, dtype=np.uint32)
        guide.write_mask_into(m.ctypes.data, self.words, 4)
        self._masks[state] = m
        if len(self._masks) > self.max_states:
            self._masks.popitem(last=False)
        return m

    def eos_only(self, guide: Any) -> bool:
        """True when ``guide`` allows no token but EOS now (also when it allows none at all)."""
        import numpy as np

        return not np.any(self.mask(guide) & self._not_eos)


def guide_masks(seq: Any, eos_token_ids: list[int], vocab_size: int) -> GuideMasks:
    """``seq.guide_masks``, made on first use (one :class:`GuideMasks` per constrained sequence)."""
    masks = getattr(seq, "guide_masks", None)
    if masks is None:
        masks = seq.guide_masks = GuideMasks(eos_token_ids, vocab_size)
    return masks


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The mask, one token at a time in Python: the obvious version that the fast one is tested against.

    Args, Returns: as :func:`apply_token_bitmask`.
    """
    out = logits.clone()
    vocab = logits.shape[1]
    for r, row in enumerate(rows.tolist()):
        words = bitmask[r].tolist()
        for v in range(vocab):
            if v // 32 >= len(words) or not (words[v // 32] >> (v % 32)) & 1:  # past the mask: disallowed
                out[row, v] = float("-inf")
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf`` the logits of the tokens a row's bitmask disallows; other rows untouched.

    Bit ``v % 32`` of word ``v // 32`` of a row's mask is 1 when token ``v`` is allowed
    (outlines-core's and xgrammar's layout). Unpacking a ``[R, W]`` mask is a shift by
    ``0..31`` and an ``& 1`` per word: ``R * 32 * W`` booleans, about ``R * V`` bytes, against
    the 4 ``R * V`` bytes of the rows' logits. Tokens past ``32 * W`` are disallowed.

    Args:
        logits: ``[B, V]`` float.
        bitmask: ``[R, W]`` int32 on the logits' device; ``W = ceil(V / 32)`` words, or fewer (the
            tokens past bit ``32 W`` are disallowed).
        rows: ``[R]`` int64, the logits row each mask row applies to (distinct).

    Returns:
        A new ``[B, V]`` tensor (``logits`` itself is not modified); rows not in ``rows`` are
        bit-for-bit the input's.
    """
    # >>> EXERCISE token_bitmask
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]: bit j of word w is token 32 w + j
    allowed = bits.view(bitmask.shape[0], -1)[:, :vocab].bool()  # [R, V]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out
    # <<< EXERCISE token_bitmask

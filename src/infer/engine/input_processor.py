"""From a prompt as a user sends it (text or token ids) to checked token ids, before the engine sees it.

Tokenizing is the one step of a request whose cost grows with what the client sends: a 5 MB
prompt takes seconds to tokenize, only to be rejected for being longer than the context. So, as
vLLM's front end does, it happens *before* the request reaches the engine thread:

* :meth:`InputProcessor.check_text_size` rejects a text that cannot fit without tokenizing it: a
  token covers at most as many characters as the longest token of the vocabulary, so a text longer
  than ``max_model_len`` times that (with a margin for normalizers) has more tokens than the context
  holds. It costs a ``len()``.
* :meth:`InputProcessor.process` tokenizes the rest, with the tokenizer's batch call, which releases
  Python's GIL while the Rust tokenizer runs: on a worker thread it stalls neither the server's event
  loop nor the engine thread.

The result is a :class:`TokensPrompt` (vLLM's name: ids, and the text they came from), which
:meth:`~infer.engine.llm_engine.LLMEngine.add_request` takes without tokenizing again. The object
holds only immutable state, so any thread may call it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from infer.errors import InvalidRequestError
from infer.tokenizer import Tokenizer

#: A text up to this many times ``max_model_len`` x the longest token's characters is tokenized; a
#: longer one is rejected unread. (A token never covers more characters than its own string has, but a
#: normalizer may fold several characters into one: the margin keeps such a prompt from a false 400.)
CHARS_MARGIN = 2


@dataclass(frozen=True)
class TokensPrompt:
    """A prompt already tokenized and checked: ``prompt_token_ids`` and, when it was sent as text,
    that text (``prompt``, echoed back and kept in the outputs)."""

    prompt_token_ids: list[int]
    prompt: str | None = None


class InputProcessor:
    """Checks and tokenizes prompts for one model (thread-safe).

    Args:
        tokenizer: the model's :class:`~infer.tokenizer.Tokenizer`.
        max_model_len: the context in tokens (prompt + output).
        vocab_size: token ids must be in ``[0, vocab_size)``.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """The longest text worth tokenizing: ``CHARS_MARGIN x max_model_len x`` the longest token's
        characters (computed once from the vocabulary: ~0.1 s for 50k tokens, ~0.8 s for 262k)."""
        return CHARS_MARGIN * self.max_model_len * self.tokenizer.max_token_chars

    def check_text_size(self, text: str, param: str = "prompt") -> None:
        """Reject ``text`` unread if it cannot fit the context whatever its tokens (:meth:`check_chars`)."""
        self.check_chars(len(text), param)

    def check_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Reject a text of ``num_chars`` characters that cannot fit the context whatever its tokens.

        Raises:
            InvalidRequestError: naming ``param``, with the number of characters and the limit.
        """
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param} has {num_chars:,} characters: more tokens than this model's context of "
                f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars:,} characters are read)",
                param=param)

    def process(self, prompt: str | list[int] | TokensPrompt) -> TokensPrompt:
        """``prompt``'s token ids, checked: a text is measured (:meth:`check_text_size`), then
        tokenized (BOS added as the model wants); token ids must be ints in the vocabulary. The
        context length itself is checked by the engine, which knows ``max_tokens``.

        Raises:
            InvalidRequestError: an empty prompt (text that encodes to zero tokens included), a text
                too long to read, ids outside the vocabulary, wrong types.
        """
        if isinstance(prompt, TokensPrompt):
            self.check_token_ids(prompt.prompt_token_ids)
            return prompt
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            self.check_text_size(prompt)
            ids = self.tokenizer.encode(prompt)
            if not ids:  # e.g. a lone control character that the vocabulary has no token for
                raise InvalidRequestError(
                    f"prompt {prompt[:32]!r} encodes to zero tokens with this model's tokenizer; "
                    "a prompt needs at least one token", param="prompt")
            return TokensPrompt(ids, prompt)
        self.check_token_ids(prompt)
        return TokensPrompt(list(prompt))

    def check_token_ids(self, ids) -> None:
        """Raise :class:`InvalidRequestError` unless ``ids`` is a non-empty list of ints in the vocabulary."""
        # (C-level checks first: a 4k-token prompt costs ~1.5 ms in a generator expression)
        if not isinstance(ids, (list, tuple)) or not (set(map(type, ids)) <= {int} or all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        )):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
            )

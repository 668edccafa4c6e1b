"""The requests the benchmark programs send: prompts made without a tokenizer, so any model (and any
server) will do.

**Serving prompts** (serve_bench.py). Text prompts are random words from :data:`WORDS`, joined by
spaces. Every word is a short, common, lower-case English word, which BPE tokenizers with a
vocabulary of 32k or more (GPT-2, Llama 2/3, SmolLM, Qwen, Gemma) encode as one token together with
its leading space, so ``n`` words are approximately ``n`` tokens (plus a BOS token, and plus the chat
template's tokens on ``/v1/chat/completions``). The benchmark records the server's own count
(``usage.prompt_tokens``) whenever the server reports usage, so the approximation is checked
in every report rather than trusted.

Token-id prompts (``token_prompt``) are exact: ``n`` ids drawn uniformly from a range that
is valid for every common vocabulary. Only ``/v1/completions`` accepts them (infer and vLLM do;
OpenAI itself does not).

**The offline workload** (offline_throughput.py, step_profile.py): nano-vllm's ``bench.py``
requests, :func:`build_workload` (:class:`Workload`), their sizes scaled by :func:`scaled_sizes`.

**One prompt of random token ids** (single_stream.py, server_latency.py): :func:`random_prompt`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show also around "
    "form three small set put end does another well large must big even such because turn here why ask "
    "went men read need land different home us move try kind hand picture again change off play spell "
    "air away animal house point page letter mother answer found study still learn should world high "
    "every near add food between own below country plant last school father keep tree never start city "
    "earth eye light thought head under story saw left few while along might close something seem next "
    "hard open example begin life always those both paper together got group often run important until "
    "children side feet car mile night walk white sea began grow took river four carry state once book "
    "hear stop without second later miss idea enough eat face watch far really almost let above girl "
    "sometimes mountain cut young talk soon list song being leave family"
).split()


def text_prompt(rng: random.Random, n_words: int) -> str:
    """``n_words`` random words (about ``n_words`` tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(n_words, 1)))


def token_prompt(rng: random.Random, n_tokens: int, lo: int = 1000, hi: int = 20000) -> list[int]:
    """``n_tokens`` token ids drawn uniformly from ``[lo, hi)``."""
    return [rng.randrange(lo, hi) for _ in range(max(n_tokens, 1))]


@dataclass
class Request:
    idx: int
    prompt: str | list[int]
    input_len: int  # the length asked for (words or token ids); the server's count is in usage
    output_len: int
    kind: str = "random"  # random | shared-prefix | short | long | stream
    extra: dict = field(default_factory=dict)


def build_requests(workload: str, num_requests: int, input_len: int, output_len: int, seed: int, *,
                   token_prompts: bool = False, prefix_len: int = 0, long_fraction: float = 0.1,
                   long_len: int = 0, token_range: tuple[int, int] = (1000, 20000), long_prompts: int = 1,
                   long_output_len: int = 16, long_start_s: float = 2.0,
                   long_interval_s: float = 5.0, turns: int = 4) -> list[Request]:
    """The requests of one workload, the same for every request rate of a sweep.

    * ``random``: ``input_len`` random words (or token ids) each.
    * ``shared-prefix``: one ``prefix_len`` prefix shared by all, then ``input_len`` unique words.
    * ``long-prompt-interference``: ``round(long_fraction * num_requests)`` requests (at random
      positions, never the first) have ``long_len`` prompts; the others ``input_len``.
    * ``decode-interference`` (chunked prefill, phase 6): ``num_requests`` decode *streams*
      (``input_len`` prompts, ``output_len`` tokens, sent at once), then ``long_prompts`` requests
      with ``long_len`` prompts and ``long_output_len`` tokens, sent ``long_start_s``,
      ``long_start_s + long_interval_s``, ... seconds later, while the streams decode. The send
      offset of each request is ``extra["arrival_s"]``.
    * ``multi-turn`` (prefix caching, phase 7): ``num_requests`` conversations of ``turns`` turns;
      each turn is ``input_len`` new words (the first turn of every conversation starts with one
      shared ``prefix_len``-word system prompt, when ``prefix_len > 0``). The client sends a turn
      after the previous one's reply, resending the history (earlier prompts and replies) before
      it: ``extra["conversation"]``, ``extra["turn"]``. Text prompts only (the history holds the
      replies' text).
    """
    rng = random.Random(seed)

    def prompt(n: int) -> str | list[int]:
        return token_prompt(rng, n, *token_range) if token_prompts else text_prompt(rng, n)

    reqs: list[Request] = []
    if workload == "random":
        reqs = [Request(i, prompt(input_len), input_len, output_len) for i in range(num_requests)]
    elif workload == "shared-prefix":
        prefix = prompt(prefix_len)
        for i in range(num_requests):
            suffix = prompt(input_len)
            p = prefix + suffix if token_prompts else f"{prefix} {suffix}"
            reqs.append(Request(i, p, prefix_len + input_len, output_len, "shared-prefix",
                                {"prefix_len": prefix_len}))
    elif workload == "long-prompt-interference":
        n_long = round(long_fraction * num_requests)
        if long_fraction > 0 and num_requests >= 2:
            n_long = max(n_long, 1)
        long_idx = set(rng.sample(range(1, num_requests), min(n_long, max(num_requests - 1, 0))))
        for i in range(num_requests):
            n = long_len if i in long_idx else input_len
            reqs.append(Request(i, prompt(n), n, output_len, "long" if i in long_idx else "short"))
    elif workload == "decode-interference":
        for i in range(num_requests):
            reqs.append(Request(i, prompt(input_len), input_len, output_len, "stream", {"arrival_s": 0.0}))
        for k in range(long_prompts):
            reqs.append(Request(num_requests + k, prompt(long_len), long_len, long_output_len, "long",
                                {"arrival_s": long_start_s + k * long_interval_s}))
    elif workload == "multi-turn":
        if token_prompts:
            raise ValueError("multi-turn resends the replies' text: use text prompts")
        system = text_prompt(rng, prefix_len) + " " if prefix_len > 0 else ""
        for c in range(num_requests):
            for t in range(turns):
                p = (system if t == 0 else "") + text_prompt(rng, input_len) + " "
                reqs.append(Request(c * turns + t, p, input_len + (prefix_len if t == 0 else 0), output_len,
                                    "multi-turn", {"conversation": c, "turn": t}))
    else:
        raise ValueError(f"unknown workload {workload!r}")
    return reqs


# ---------------------------------------------------------------------------------- the offline workload


# nano-vllm's bench.py
DEFAULT_NUM_REQUESTS = 256
DEFAULT_MIN_LEN = 100
DEFAULT_MAX_LEN = 1024
DEFAULT_TOKEN_MAX = 10000
WARMUP_REQUESTS, WARMUP_PROMPT, WARMUP_OUTPUT = 4, 16, 4


@dataclass
class Workload:
    """The requests: ``prompts[i]`` (token ids) asks for ``output_lens[i]`` tokens."""

    prompts: list[list[int]]
    output_lens: list[int]
    params: dict[str, Any]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))


def scaled_sizes(scale: float = 1.0, num_requests: int | None = None, min_len: int | None = None,
                 max_len: int | None = None, min_output_len: int | None = None,
                 max_output_len: int | None = None) -> dict[str, int]:
    """nano-vllm's sizes times ``scale`` (each at least 1).

    Explicit values win; the output bounds default to the prompt bounds; a scaled bound that
    would cross an explicit one is clipped to it (``--max-len 8`` alone gives lengths up to 8).

    Raises:
        ValueError: when two explicit bounds cross.
    """
    def s(x: int) -> int:
        return max(1, round(x * scale))

    def bounds(lo: int | None, hi: int | None, dlo: int, dhi: int) -> tuple[int, int]:
        if lo is not None and hi is not None:
            return lo, hi
        if lo is not None:
            return lo, max(lo, dhi)
        if hi is not None:
            return min(dlo, hi), hi
        return dlo, dhi

    lo, hi = bounds(min_len, max_len, s(DEFAULT_MIN_LEN), s(DEFAULT_MAX_LEN))
    olo, ohi = bounds(min_output_len, max_output_len, lo, hi)
    out = {"num_requests": num_requests or s(DEFAULT_NUM_REQUESTS), "min_len": lo, "max_len": hi,
           "min_output_len": olo, "max_output_len": ohi}
    for a, b in (("min_len", "max_len"), ("min_output_len", "max_output_len")):
        if out[b] < out[a] or out[a] < 1:
            raise ValueError(f"{b}={out[b]} < {a}={out[a]}" if out[a] >= 1 else f"{a} must be >= 1")
    return out


def build_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0,
                   min_output_len: int | None = None, max_output_len: int | None = None,
                   token_max: int = DEFAULT_TOKEN_MAX) -> Workload:
    """nano-vllm's requests: prompt lengths, token ids and output lengths all uniform (inclusive)."""
    min_output_len = min_len if min_output_len is None else min_output_len
    max_output_len = max_len if max_output_len is None else max_output_len
    hi = min(token_max, vocab_size - 1)
    rng = random.Random(seed)
    prompts = [[rng.randint(0, hi) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    output_lens = [rng.randint(min_output_len, max_output_len) for _ in range(num_requests)]
    params = {"num_requests": num_requests, "min_len": min_len, "max_len": max_len,
              "min_output_len": min_output_len, "max_output_len": max_output_len, "seed": seed,
              "token_range": [0, hi], "ignore_eos": True}
    return Workload(prompts, output_lens, params)


def warmup_workload(wl: Workload) -> Workload:
    """The untimed warm-up: the first few requests, cut to 16 prompt tokens and 4 output tokens."""
    k = min(WARMUP_REQUESTS, wl.num_requests)
    return Workload([p[:WARMUP_PROMPT] for p in wl.prompts[:k]], [min(o, WARMUP_OUTPUT) for o in wl.output_lens[:k]],
                    {"warmup": True})


# ---------------------------------------------------------------------------------- one random prompt


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` token ids uniform in ``[100, vocab - 100)`` (clear of the special tokens at either end),
    from torch's CPU generator seeded with ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

"""The tokenizers infer rebuilds from GGUF metadata, against references.

The reference is transformers' own GGUF conversion (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), run once per session in a separate process (see ``hf_job``). Where the two
disagree, the test follows the model's original tokenizer (and llama.cpp, which wrote these
files) and says why:

* **SmolLM2, digits.** SmolLM2's tokenizer isolates every digit *before* the GPT-2 regex runs
  (its tokenizer.json: ``Digits(individual_digits=True)`` then ``ByteLevel(use_regex=True)``;
  llama.cpp's ``smollm`` pre-tokenizer: ``\\p{N}`` then the GPT-2 regex, each regex applied to
  the pieces of the previous one). transformers' GGUF conversion drops the digit split. The
  vocabulary has no token holding a digit next to anything else, so digits themselves come out
  the same, but the whitespace *before* a digit does not: ``":\\n\\n1."`` is ``: ĊĊ 1 .`` for
  SmolLM2 (``"\\n\\n"`` ends its piece, so ``\\s+(?!\\S)`` takes both newlines) and
  ``: Ċ Ċ 1 .`` for transformers. Texts with digits are therefore checked against HF's
  vocabulary and merges driven by SmolLM2's real pre-tokenizer, not against HF's conversion.
* **Gemma 3, runs of more than 31 spaces.** Gemma's runs of 2..31 spaces are *user-defined*
  SentencePiece pieces, which SentencePiece matches whole, longest first, before BPE (its
  ``PrefixMatcher``; llama.cpp likewise splits them out of the raw text first): 38 spaces are
  ``31 + 7``. transformers' conversion turns them into ordinary BPE merges, which gives
  ``16 + 22``. Up to 31 spaces both agree; beyond, we check SentencePiece's answer.

infer used to add those user-defined pieces (spelled ``"▁▁"``...) as added tokens matched
against the *raw* text, where spaces are still spaces, so they never matched and ``"    if"``
became ``▁ ▁ ▁ ▁if`` instead of ``▁▁▁▁ if``; :func:`infer.loader.gguf_tokenizer.sentencepiece_bpe`
now matches them in the normalized text (and the tokenizer cache version went to 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

COMMON_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "double  space and   triple",
    "tabs\tand\t\ttabs",
    "line1\nline2\n\nline4\n\n\n",
    "\n\n\n",
    "   ",
    "a\r\nb",
    "def f(x):\n    if x:\n        return x\n    return None\n",
    "class A:\n\tdef g(self):\n\t\tpass\n",
    "don't you'll I'm we've THEY'RE",
    "mixed CASE and_under-score, http://example.com/a?b=c&d=e",
    "café naïve résumé Ünïcödé",
    "日本語のテキスト、中文测试。한국어",
    "emoji 😀🎉👍🏽 and a flag 🇫🇷",
    "math Ω≈ç√∫ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\u200b zero width\u00a0nbsp",
]
DIGIT_TEXTS = [
    "12345",
    "3.14159",
    "year 2024",
    "x = 1 + 22 * 333",
    ":\n\n1. first\n2. second",
    "[0  1  2]",
    "\t42\n",
    "v1.2.3-rc4",
    "Arabic-Indic ٣٤٥ and superscript x² ½",
]


# ----------------------------------------------------------------------------- references
#
# transformers' conversion of the two GGUFs takes ~20 s on a small CPU, mostly parsing their
# metadata. It runs in a fresh interpreter (this file run as a script: no infer code in it)
# started before the models load, so that both overlap; that process writes, per model, the
# ids transformers gives for every text, as soon as that model is done.

SMOLLM2_SPECIAL = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>after"]
GEMMA3_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>already there",
    "31 spaces:" + " " * 31 + "end",
    "rare: 𠀀 𓀀 \U0001fae8 ᚠᛇᚻ ꙮ \u0378",
]
REFERENCE_TEXTS = {
    "smollm2-135m": COMMON_TEXTS + SMOLLM2_SPECIAL,
    "gemma3-270m": COMMON_TEXTS + DIGIT_TEXTS + GEMMA3_TEXTS,
}


def _transformers_reference(jobs: dict[str, dict], out: Path) -> None:
    """For each model: ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` (its GGUF reader
    sped up by ``hf_reference.fast_gguf_reader``, nothing else changed) and its ids for every text, to
    ``out/<model>.json``. Runs as this file's ``__main__`` (tests/ first on the path)."""
    from hf_reference import fast_gguf_reader
    from transformers import AutoTokenizer

    for name, job in jobs.items():
        path = Path(job["path"])
        with fast_gguf_reader():
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        result = {
            "plain": [tok.encode(t, add_special_tokens=False) for t in job["texts"]],
            "special": [tok.encode(t) for t in job["texts"]],
            "backend": tok.backend_tokenizer.to_str(),
        }
        tmp = out / f"{name}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(out / f"{name}.json")


class ReferenceIds:
    """transformers' ids for the texts of :data:`REFERENCE_TEXTS`, with ``encode``'s signature."""

    def __init__(self, texts: list[str], result: dict) -> None:
        self.plain = dict(zip(texts, result["plain"]))
        self.special = dict(zip(texts, result["special"]))
        self.backend_json = result["backend"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (self.special if add_special_tokens else self.plain)[text]


@pytest.fixture(scope="session")
def hf_job(tmp_path_factory):
    """Start transformers' conversions in a fresh interpreter (session scope: before the
    session-scoped model fixtures, so that they load meanwhile)."""
    from infer.loader.registry import shipped_model_path

    out = tmp_path_factory.mktemp("hf_reference")
    jobs = {name: {"path": str(shipped_model_path(name)), "texts": texts} for name, texts in REFERENCE_TEXTS.items()}
    (out / "jobs.json").write_text(json.dumps(jobs))
    log = open(out / "stderr.txt", "wb")
    proc = subprocess.Popen([sys.executable, __file__, str(out)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=Path(__file__).parent.parent)
    yield proc, out, jobs
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


def _reference(hf_job, name: str, loaded) -> ReferenceIds:
    proc, out, jobs = hf_job
    assert Path(jobs[name]["path"]) == loaded.path
    result = out / f"{name}.json"
    deadline = time.monotonic() + 600
    while not result.is_file():
        if proc.poll() is not None and not result.is_file():
            raise RuntimeError(f"transformers reference failed:\n{(out / 'stderr.txt').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"transformers reference for {name}: no result after 600 s")
        time.sleep(0.05)
    return ReferenceIds(jobs[name]["texts"], json.loads(result.read_text()))


@pytest.fixture(scope="session")
def hf_smollm2(hf_job, smollm2):
    return _reference(hf_job, "smollm2-135m", smollm2)


@pytest.fixture(scope="session")
def hf_gemma3(hf_job, gemma3):
    return _reference(hf_job, "gemma3-270m", gemma3)


@pytest.fixture(scope="module")
def smollm2_original(hf_smollm2):
    """HF's vocabulary and merges for SmolLM2, with SmolLM2's real pre-tokenizer."""
    from tokenizers import Tokenizer, pre_tokenizers

    tk = Tokenizer.from_str(hf_smollm2.backend_json)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tk


def tokens(tok, ids: list[int]) -> list[str]:
    return [tok.id_to_token(i) for i in ids]


# ----------------------------------------------------------------------------- SmolLM2


@pytest.mark.parametrize("text", REFERENCE_TEXTS["smollm2-135m"])
def test_smollm2_matches_transformers(hf_smollm2, smollm2, text):
    ours = smollm2.tokenizer
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf_smollm2.encode(text, add_special_tokens=False), tokens(ours, ids)
    assert ours.encode(text) == hf_smollm2.encode(text) == ids  # no BOS for SmolLM2
    assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_smollm2_digits_match_the_original_pre_tokenizer(smollm2, smollm2_original, text):
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert ids == smollm2_original.encode(text, add_special_tokens=False).ids, tokens(smollm2.tokenizer, ids)
    assert smollm2.tokenizer.decode(ids) == text


def test_smollm2_every_digit_is_its_own_token(smollm2):
    tok = smollm2.tokenizer
    assert tokens(tok, tok.encode("12345", add_special_tokens=False)) == ["1", "2", "3", "4", "5"]
    assert tokens(tok, tok.encode("year 2024", add_special_tokens=False)) == ["year", "Ġ", "2", "0", "2", "4"]
    # whitespace before a digit ends its own piece (llama.cpp's smollm split; HF's conversion: Ċ Ċ)
    assert tokens(tok, tok.encode(":\n\n1.", add_special_tokens=False)) == [":", "ĊĊ", "1", "."]
    assert tokens(tok, tok.encode("0  1", add_special_tokens=False)) == ["0", "ĠĠ", "1"]
    # \p{N}, not just ASCII: one piece per numeric character (here each piece is 2 byte tokens)
    for text in ("٣٤٥", "²½"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == [i for c in text for i in tok.encode(c, add_special_tokens=False)]
        assert tok.decode(ids) == text


def test_smollm2_vocabulary_never_joins_a_digit(smollm2):
    """Why digits alone come out the same with or without the digit split: no token holds a
    numeric character next to anything else."""
    import unicodedata

    from infer.tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tok = smollm2.tokenizer
    for i in range(tok.vocab_size):
        spelled = tok.id_to_token(i)
        if not set(spelled) <= byte_of.keys():
            continue
        raw = bytes(byte_of[c] for c in spelled)
        for c in raw.decode("utf-8", errors="ignore"):
            if unicodedata.category(c).startswith("N"):
                assert raw == c.encode(), (i, spelled)


def test_smollm2_special_tokens_and_ids_from_metadata(smollm2):
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == 1
    assert tok.id_to_token(2) == "<|im_end|>"
    assert 2 in tok.eos_token_ids and 2 in smollm2.config.eos_token_ids
    assert tok.bos_token_id == 1
    assert not tok.add_bos_token
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)) == "hi"


# ----------------------------------------------------------------------------- Gemma 3


@pytest.mark.parametrize("text", REFERENCE_TEXTS["gemma3-270m"])
def test_gemma3_matches_transformers(hf_gemma3, gemma3, text):
    ours = gemma3.tokenizer
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf_gemma3.encode(text, add_special_tokens=False), tokens(ours, ids)
    assert ours.encode(text) == hf_gemma3.encode(text) == [2, *ids]  # BOS prepended
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_gemma3_whitespace_runs_are_single_pieces(gemma3):
    tok = gemma3.tokenizer
    assert tokens(tok, tok.encode("    if x:", add_special_tokens=False)) == ["▁▁▁▁", "if", "▁x", ":"]


    def spaces(n: int) -> int:  # ids 138..167: runs of 2..31 spaces
        assert 2 <= n <= 31
        return 138 + n - 2

    assert [tok.id_to_token(spaces(n)) for n in (2, 31)] == ["▁▁", "▁" * 31]
    assert tok.encode("  ", add_special_tokens=False) == [spaces(2)]
    assert tok.encode(" " * 31, add_special_tokens=False) == [spaces(31)]
    # SentencePiece matches user-defined pieces longest first (HF's conversion: 16 + 22)
    assert tok.encode(" " * 38, add_special_tokens=False) == [spaces(31), spaces(7)]
    assert tok.encode("\n" + " " * 64 + "x", add_special_tokens=False)[:4] == [107, spaces(31), spaces(31), spaces(2)]


def test_gemma3_byte_fallback(gemma3):
    tok = gemma3.tokenizer
    ids = tok.encode("𠀀", add_special_tokens=False)  # U+20000, not in the vocabulary
    assert tokens(tok, ids) == ["<0xF0>", "<0xA0>", "<0x80>", "<0x80>"]
    assert tok.decode(ids) == "𠀀"


def test_gemma3_special_tokens_and_ids_from_metadata(gemma3):
    tok = gemma3.tokenizer
    assert tok.bos_token_id == 2 and tok.id_to_token(2) == "<bos>"
    assert 1 in tok.eos_token_ids and tok.id_to_token(1) == "<eos>"
    assert 1 in gemma3.config.eos_token_ids and gemma3.config.bos_token_id == 2
    assert tok.add_bos_token
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert ids[:2] == [2, tok.token_to_id("<start_of_turn>")]
    assert tok.token_to_id("<end_of_turn>") in ids
    assert tok.decode(ids) == "user\nhi"


# ----------------------------------------------------------------------------- the cache


@pytest.fixture(scope="module")
def smollm2_meta(smollm2):
    from infer.loader import gguf as g

    return g.read_metadata(g.open_gguf(smollm2.path))


def test_tokenizer_cache(smollm2, smollm2_meta, tmp_path, monkeypatch):
    from infer.loader import gguf as g
    from infer.loader import gguf_tokenizer

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    path = smollm2.path
    cache = g.cached_path(path, "tokenizer.json")
    assert cache.is_relative_to(tmp_path) and not cache.exists()

    built = g.gguf_tokenizer(smollm2_meta, path)
    assert cache.is_file()
    assert [p for p in cache.parent.iterdir() if p != cache] == []  # no temp file left behind

    def no_build(*args, **kwargs):
        raise AssertionError("the tokenizer was rebuilt instead of read from the cache")

    monkeypatch.setattr(gguf_tokenizer, "build_tokenizer", no_build)
    cached = g.gguf_tokenizer(smollm2_meta, path)
    for text in COMMON_TEXTS + DIGIT_TEXTS + SMOLLM2_SPECIAL:
        expected = smollm2.tokenizer.encode(text, add_special_tokens=False)
        assert built.encode(text, add_special_tokens=False) == expected
        assert cached.encode(text, add_special_tokens=False) == expected
    assert cached.eos_token_ids == built.eos_token_ids == [2]
    assert cached.bos_token_id == built.bos_token_id
    assert cached.add_bos_token == built.add_bos_token
    assert cached.chat_template == built.chat_template == smollm2_meta["tokenizer.chat_template"]


def test_corrupt_cache_is_rebuilt(smollm2, smollm2_meta, tmp_path, monkeypatch):
    from infer.loader import gguf as g
    from infer.loader import gguf_tokenizer

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    cache = g.cached_path(smollm2.path, "tokenizer.json")
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    tok = g.gguf_tokenizer(smollm2_meta, smollm2.path)
    assert tok.encode("Hello, world!") == smollm2.tokenizer.encode("Hello, world!")
    assert cache.read_text().startswith("{")

    def no_build(*args, **kwargs):
        raise AssertionError("the rewritten cache file should have been used")

    monkeypatch.setattr(gguf_tokenizer, "build_tokenizer", no_build)
    again = g.gguf_tokenizer(smollm2_meta, smollm2.path)
    assert again.encode("Hello, world!") == tok.encode("Hello, world!")


def test_special_ids_follow_the_metadata(smollm2_meta, tmp_path, monkeypatch):
    """EOS/BOS come from the file, not from a table: change the metadata, they change."""
    from infer.loader import gguf as g

    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path))
    meta = {**smollm2_meta, "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.eot_token_id": 2,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": True}
    source = tmp_path / "edited.gguf"  # the cache key is the file's name, size and mtime
    source.write_bytes(b"GGUF")
    tok = g.gguf_tokenizer(meta, source)
    assert tok.eos_token_ids == [0, 2]
    assert tok.bos_token_id == 0 and tok.add_bos_token
    assert tok.encode("hi")[0] == 0


if __name__ == "__main__":  # the reference process started by the hf_job fixture
    out_dir = Path(sys.argv[1])
    _transformers_reference(json.loads((out_dir / "jobs.json").read_text()), out_dir)

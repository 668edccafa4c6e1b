"""Stream a completion or a chat reply to the terminal.

    python -m infer.generate "The capital of France is"          # completion
    python -m infer.generate --chat "Write a haiku about tea"    # one chat turn
    python -m infer.generate --chat                               # interactive chat (Ctrl-D quits)
    python -m infer.generate --model gemma3-270m --max-tokens 64 --temperature 0 "Once upon"

Every :class:`~infer.config.EngineConfig` field is a flag (``--help`` lists them).
"""

from __future__ import annotations

import argparse
import sys
import time

from infer.config import add_engine_args, engine_config_from_args
from infer.errors import InvalidRequestError, ModelLoadError
from infer.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("prompt", nargs="?", help="the prompt; omit it for an interactive session")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (a chat turn)")
    p.add_argument("--system", default=None, help="system message for --chat")
    s = p.add_argument_group("sampling (SamplingParams)")
    s.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    s.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: 0.7)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    s.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens, -1 = all")
    s.add_argument("--min-p", type=float, default=0.0, help="min-p threshold (default: 0)")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL repetition penalty (default: 1)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    add_engine_args(p)
    return p


def _stream(llm, prompt_ids, params, out) -> None:
    start = time.perf_counter()
    first = None
    n = 0
    final = None
    for delta in llm.generate_stream(prompt_ids, params):
        c = delta.outputs[0]
        if c.delta_token_ids and first is None:
            first = time.perf_counter()
        n += len(c.delta_token_ids)
        out.write(c.delta_text)
        out.flush()
        final = c
    end = time.perf_counter()
    tpot = (end - first) / max(n - 1, 1) * 1000 if first else 0.0
    ttft = ((first or end) - start) * 1000
    sys.stderr.write(
        f"\n[{n} tokens, finish_reason={final.finish_reason if final else None}, "
        f"TTFT {ttft:.0f} ms, TPOT {tpot:.1f} ms]\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from infer.llm import LLM

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(**engine_config_from_args(args).to_dict())
    except (ValueError, TypeError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []

    def turn(text: str) -> None:
        if args.chat:
            history.append({"role": "user", "content": text})
            ids = llm.chat_prompt_ids(history)
        else:
            ids = llm.tokenizer.encode(text)
        reply = []

        class Tee:
            def write(self, s):
                reply.append(s)
                sys.stdout.write(s)

            def flush(self):
                sys.stdout.flush()

        _stream(llm, ids, params, Tee())
        if args.chat:
            history.append({"role": "assistant", "content": "".join(reply)})

    try:
        if args.prompt is not None:
            turn(args.prompt)
            return 0
        while True:
            try:
                text = input("\n>>> " if args.chat else "\nprompt> ")
            except EOFError:
                print()
                return 0
            if text.strip():
                turn(text)
    except (InvalidRequestError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

"""``meshserve``: the command line (``generate`` offline; ``up`` starts the mesh; ``distill``
builds a draft model for speculative decoding)."""

from __future__ import annotations

import argparse
import sys

from services.launcher.flags import add_model_format_args, add_tensor_parallel_arg
from services.launcher.up import add_up
from tools.distill.cli import add_distill


def add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="complete one prompt offline with the engine")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_model_format_args(p)
    add_tensor_parallel_arg(p)
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    # The runtime (torch) is imported only to generate: every ``meshserve`` command builds
    # this parser, and ``meshserve up`` must stay a light process (it only starts the runtime
    # in other processes).
    from common.tokenizer import Tokenizer
    from gpu.engine import Engine
    from gpu.gguf import resolve_model_path
    from gpu.replica import build_runner
    from gpu.sampling_params import SamplingParams

    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    prompt = tokenizer.encode(text, add_special_tokens=not args.chat)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    runner = build_runner(
        folder,
        quantization=args.quantization,
        num_pages=-(-(len(prompt) + args.max_tokens) // 16),
        kv_cache=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    try:
        engine = Engine(runner, eos_token_ids=tokenizer.eos_token_ids)
        output = engine.generate([prompt], params)[0]
    finally:
        runner.close()
    print(tokenizer.decode(output))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve", description="LLM serving on a NATS mesh")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate(sub)
    add_up(sub)
    add_distill(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:  # ModelError is a ValueError
        print(f"meshserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

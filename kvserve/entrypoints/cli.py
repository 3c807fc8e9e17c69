"""`kvserve` command line: `kvserve serve`, `kvserve chat`, `kvserve generate`, `kvserve bench`, `kvserve plan`, `kvserve tune`."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve import log_safety
from kvserve.entrypoints.cli_args import add_engine_args, engine_args_from_namespace


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Sampling options")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")


def _make_llm(ns):
    from kvserve.entrypoints.llm import LLM

    return LLM.from_engine_args(engine_args_from_namespace(ns, ns.model))


def _params(ns):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens, seed=ns.sampling_seed
    )


def cmd_chat(ns) -> int:
    llm = _make_llm(ns)
    messages = [{"role": "user", "content": m} for m in ns.messages]
    for out in llm.chat([[m] for m in messages], _params(ns), use_tqdm=False):
        print(out.outputs[0].text)
    return 0


def cmd_generate(ns) -> int:
    llm = _make_llm(ns)
    for out in llm.generate(ns.prompts, _params(ns), use_tqdm=False):
        print(out.prompt + out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    import kvserve
    from kvserve.entrypoints.collect_env import cmd_collect_env

    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference with paged KV cache")
    parser.add_argument("--version", action="version", version=kvserve.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("collect-env", help="Print versions of Python, torch, CUDA, GPUs, drivers and packages "
                                             "(paste it into bug reports).")
    env.set_defaults(func=cmd_collect_env)

    chat = sub.add_parser("chat", help="Answer chat messages offline (one conversation each) and print the replies.")
    chat.add_argument("messages", nargs="+", help="User messages.")
    chat.add_argument("--model", default=None, help="Model directory or .gguf (default: embedded SmolLM2).")
    add_engine_args(chat)
    _sampling_flags(chat)
    chat.set_defaults(func=cmd_chat)

    gen = sub.add_parser("generate", help="Complete prompts offline and print prompt + completion.")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default=None)
    add_engine_args(gen)
    _sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    from kvserve.bench.cli import add_bench_parser
    from kvserve.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)

    from kvserve.entrypoints import plan

    plan_parser = sub.add_parser("plan", help="Will MODEL fit? Memory per GPU and what to change (reads config only).")
    plan.add_arguments(plan_parser)
    plan_parser.set_defaults(func=plan.run)

    from kvserve.bench import tune

    tune_parser = sub.add_parser("tune", help="Short benchmarks in the tuning order; prints the best command line.",
                                 description=tune.__doc__.split("\n\n")[0])
    tune.add_arguments(tune_parser)
    tune_parser.set_defaults(func=tune.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    log_safety.install()
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:  # bad flags, or no model where one was expected
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

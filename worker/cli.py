"""The `inferq` command: one entry point, each subcommand loading only what it needs."""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Callable[[argparse.Namespace, list[str]], int] = args.handler
    return handler(args, extra)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferq", description=__doc__)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="manage model files").add_subparsers(
        dest="action", required=True
    )
    pull = model.add_parser("pull", help="prepare a model as an HF folder in the cache")
    pull.add_argument("name", nargs="?", default=None, help="registry name, folder or hub id")
    pull.set_defaults(handler=_model_pull)

    generate = commands.add_parser("generate", help="generate offline, in this process")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--model", default=None)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.set_defaults(handler=_generate)

    from producer_api.serve import add_api_arguments
    from producer_api.up import add_up_arguments

    up = commands.add_parser("up", help="start Redis (if none answers), the API and one worker")
    add_up_arguments(up)
    up.set_defaults(handler=_up)
    api = commands.add_parser("api", help="run the HTTP API (uvicorn)")
    add_api_arguments(api)
    api.set_defaults(handler=_api)

    from worker.main import add_worker_arguments

    worker = commands.add_parser("worker", help="run a worker: the model's job stream -> engine")
    add_worker_arguments(worker)
    worker.set_defaults(handler=_worker)

    from producer_api.status_cli import add_status_arguments

    status = commands.add_parser(
        "status", help="models, workers, queues and dead letters, read from Redis"
    )
    add_status_arguments(status)
    status.set_defaults(handler=_status)

    from worker.batch_cli import add_batch_arguments

    add_batch_arguments(commands)  # inferq batch submit|run|controller

    bench = commands.add_parser("bench", help="run a benchmark from bench/ (flags pass through)")
    bench.add_argument("name", help="throughput, queue_overhead, serve, gpu, ...")
    bench.set_defaults(handler=_bench)
    return parser


def _up(args: argparse.Namespace, _: list[str]) -> int:
    from producer_api.up import run_up

    return run_up(args)


def _api(args: argparse.Namespace, _: list[str]) -> int:
    from producer_api.serve import run_api

    return run_api(args)


def _worker(args: argparse.Namespace, _: list[str]) -> int:
    from worker.main import run_from_cli

    return run_from_cli(args)


def _status(args: argparse.Namespace, _: list[str]) -> int:
    from producer_api.status_cli import run_status

    return run_status(args)


def _model_pull(args: argparse.Namespace, _: list[str]) -> int:
    from engine.model_files import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path

    started = time.perf_counter()
    try:
        path = resolve_model_path(args.name or DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    logging.getLogger("inferq").info("model ready in %.2f s", time.perf_counter() - started)
    return 0


def _generate(args: argparse.Namespace, _: list[str]) -> int:
    from worker.main import tune_cpu_process

    tune_cpu_process("auto", None)
    from engine import LLM, SamplingParams
    from engine.model_files import DEFAULT_MODEL

    llm = LLM(args.model or DEFAULT_MODEL)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        print(f"> {prompt}\n{output.outputs[0].text}\n")
    return 0


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    script = _REPO_ROOT / "bench" / f"{args.name}.py"
    if not script.exists():
        print(
            f"error: no benchmark {script} (benchmarks run from a source checkout)", file=sys.stderr
        )
        return 2
    sys.argv = [str(script), *extra]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `inferq` command: one entry point, each subcommand loading only what it needs."""

from __future__ import annotations

import argparse
import logging
import runpy
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from cli.batch import add_batch_arguments
from cli.flags import ENGINE_SECTION, SettingsCommand, SettingsFlags, add_settings_arguments
from cli.status import add_status_arguments, run_status
from cli.up import UpSettings, run_up
from engine.config import EngineConfig
from producer_api.grpc.settings import GrpcSettings
from producer_api.settings import ApiSettings
from schemas.defaults import DEFAULT_MODEL
from worker.engine_settings import ENGINE_SETTINGS, EngineSettings
from worker.settings import WorkerSettings

_BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
LOG_LEVELS = ["debug", "info", "warning", "error"]
_CHATTY_LOGGERS = ("httpx", "httpcore")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.log_level = args.log_level or args.default_log_level
    configure_logging(args.log_level)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler: Callable[[argparse.Namespace, list[str]], int] = args.handler
    return handler(args, extra)


def configure_logging(level: str) -> None:
    """The root logger at `level`; HTTP clients log every request at INFO, which would break
    progress bars and bury what matters, so they speak up at DEBUG only."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    if level != "debug":
        for chatty in _CHATTY_LOGGERS:
            logging.getLogger(chatty).setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferq", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=None,
        choices=LOG_LEVELS,
        help="default: info; warning for `inferq up` and the processes it starts",
    )
    parser.set_defaults(default_log_level="info")
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
    engine_flags = add_settings_arguments(
        generate, EngineSettings, sections={ENGINE_SECTION: ENGINE_SETTINGS}, environment=False
    )
    generate.set_defaults(handler=partial(_generate, engine_flags))

    up = commands.add_parser("up", help="start Redis (if none answers), the API and one worker")
    up_flags = add_settings_arguments(up, UpSettings)
    # a terminal that runs the whole system shows problems, not every request and heartbeat
    up.set_defaults(handler=SettingsCommand("up", up_flags, run_up), default_log_level="warning")

    api = commands.add_parser("api", help="run the HTTP API (uvicorn)")
    # keys given on a command line would show in `ps`: INFERQ_API_KEYS only
    api_flags = add_settings_arguments(api, ApiSettings, exclude=("api_keys",))
    api.set_defaults(handler=SettingsCommand("api", api_flags, _api))

    grpc = commands.add_parser("grpc", help="run the gRPC API (the HTTP API's jobs over gRPC)")
    # every API setting applies (same environment); --port is the gRPC port, as `inferq api`'s
    # --port is the HTTP one
    grpc_flags = add_settings_arguments(
        grpc, GrpcSettings, exclude=("api_keys", "port"), aliases={"grpc_port": ["--port"]}
    )
    grpc.set_defaults(handler=SettingsCommand("grpc", grpc_flags, _grpc))

    worker = commands.add_parser(
        "worker",
        help="run a worker: the model's job stream -> engine",
        description="Serve a model's job stream until SIGTERM / SIGINT (then drain and hand "
        "back). Every flag is also INFERQ_<FLAG> in the environment.",
    )
    worker_flags = add_settings_arguments(
        worker, WorkerSettings, sections={ENGINE_SECTION: ENGINE_SETTINGS}
    )
    worker.set_defaults(handler=SettingsCommand("worker", worker_flags, _worker))

    status = commands.add_parser(
        "status", help="models, workers, queues and dead letters, read from Redis"
    )
    status_flags = add_status_arguments(status)
    status.set_defaults(handler=SettingsCommand("status", status_flags, run_status))

    add_batch_arguments(commands)

    bench = commands.add_parser(
        "bench", help="run a benchmark from bench/<group>/ (flags pass through)"
    )
    bench.add_argument(
        "name", help="throughput, queue-overhead, serve, vs-vllm, gpu, ... (or engine/vs-vllm)"
    )
    bench.set_defaults(handler=_bench)
    return parser


def _api(settings: ApiSettings, args: argparse.Namespace) -> int:
    from producer_api.serve import run_api

    return run_api(settings, args.log_level)


def _grpc(settings: GrpcSettings, _: argparse.Namespace) -> int:
    from producer_api.grpc.server import run_grpc

    return run_grpc(settings)


def _worker(settings: WorkerSettings, _: argparse.Namespace) -> int:
    from worker.main import run_worker

    return run_worker(settings)


def _model_pull(args: argparse.Namespace, _: list[str]) -> int:
    from engine.model_files import ModelNotFoundError, resolve_model_path

    started = time.perf_counter()
    try:
        path = resolve_model_path(args.name or DEFAULT_MODEL)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    logging.getLogger("inferq").info("model ready in %.2f s", time.perf_counter() - started)
    return 0


def _generate(
    engine_flags: SettingsFlags[EngineSettings], args: argparse.Namespace, _: list[str]
) -> int:
    from worker.main import tune_cpu_process

    engine_args = engine_flags.given(args)
    config = EngineConfig(model=args.model or DEFAULT_MODEL, **engine_args)
    tune_cpu_process(config.device, config.num_threads)
    from engine import LLM, SamplingParams

    llm = LLM(config.model, **engine_args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        print(f"> {prompt}\n{output.outputs[0].text}\n")
    return 0


def bench_scripts(name: str) -> list[Path]:
    """The scripts `inferq bench NAME` may mean: bench/<group>/<name>.py, NAME given with its
    group (engine/vs-vllm) or without it (vs-vllm); names are unique across the groups."""
    stem = name.replace("-", "_")
    if "/" in stem:
        script = _BENCH_DIR / f"{stem}.py"
        return [script] if script.is_file() else []
    return sorted(_BENCH_DIR.glob(f"*/{stem}.py"))


def _bench(args: argparse.Namespace, extra: list[str]) -> int:
    scripts = bench_scripts(args.name)
    if len(scripts) != 1:
        problem = (
            f"several benchmarks are named {args.name}: {', '.join(map(str, scripts))}"
            if scripts
            else f"no benchmark {args.name} in {_BENCH_DIR}/<group>/ "
            "(benchmarks run from a source checkout)"
        )
        print(f"error: {problem}", file=sys.stderr)
        return 2
    script = scripts[0]
    sys.argv = [str(script), *extra]
    runpy.run_path(str(script), run_name="__main__")
    return 0

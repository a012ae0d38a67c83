"""`inferq batch submit|run|controller`: bulk work from the command line.

`run FILE -o OUT --local` runs the file in this process through `engine.LLM.generate`, writing
the same output / error line formats as the Batch API. Lines are appended (and flushed) a chunk
at a time, so after Ctrl-C the same command resumes: it skips every custom_id already in OUT
or in the error file."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

from cli.batch_submit import add_submit_arguments, run_submit
from cli.flags import ENGINE_SECTION, SettingsCommand, SettingsFlags, add_settings_arguments
from producer_api.batches.settings import BatchControllerSettings
from schemas.defaults import DEFAULT_MODEL
from worker.engine_settings import ENGINE_SETTINGS, EngineSettings

CHUNK_LINES = 16  # lines per generate call: what a Ctrl-C can lose


def add_batch_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `inferq batch ...` on the top-level subparsers."""
    batch = commands.add_parser("batch", help="bulk work: OpenAI batch files").add_subparsers(
        dest="action", required=True
    )
    submit = batch.add_parser(
        "submit", help="submit a batch file to the API (with --wait: follow it)"
    )
    submit_flags = add_submit_arguments(submit)
    submit.set_defaults(handler=SettingsCommand("batch submit", submit_flags, run_submit))

    run = batch.add_parser("run", help="run a batch file in this process (--local), resumable")
    run.add_argument("file", type=Path)
    run.add_argument("-o", "--output", type=Path, required=True)
    run.add_argument("--errors", type=Path, help="default: OUTPUT.errors.jsonl")
    run.add_argument("--local", action="store_true", required=True, help="in-process engine")
    run.add_argument("--model", default=DEFAULT_MODEL, help="default: %(default)s")
    default_max_tokens = BatchControllerSettings.model_fields["default_max_tokens"]
    run.add_argument(
        "--default-max-tokens",
        type=int,
        default=default_max_tokens.default,
        help=default_max_tokens.description,
    )
    engine_flags = add_settings_arguments(
        run, EngineSettings, sections={ENGINE_SECTION: ENGINE_SETTINGS}, environment=False
    )
    run.set_defaults(handler=partial(_run, engine_flags))

    controller = batch.add_parser("controller", help="run the batch controller (arq worker)")
    controller.set_defaults(handler=_controller)


def _controller(args: argparse.Namespace, _: list[str]) -> int:
    # arq's own CLI would add a handler to the `arq` logger on top of the root one `inferq`
    # configured, printing every line twice; run_worker leaves logging to us.
    from arq import run_worker

    from producer_api.batches.controller import WorkerSettings

    run_worker(WorkerSettings)  # type: ignore[arg-type]  # arq's Protocol wants typed attributes
    return 0


def _run(
    engine_flags: SettingsFlags[EngineSettings], args: argparse.Namespace, _: list[str]
) -> int:
    from producer_api.batches.lines import line_of_error, parse_lines

    errors_path = args.errors or args.output.with_suffix(".errors.jsonl")
    lines = parse_lines(args.file.read_text(encoding="utf-8"), None, args.default_max_tokens)
    done = _finished(args.output) | _finished(errors_path)
    todo = [line for line in lines if not _is_done(line, done)]
    bad = [line for line in todo if not line.ok]
    good = [line for line in todo if line.ok]
    with errors_path.open("a", encoding="utf-8") as errors:
        for line in bad:
            errors.write(line_of_error(line) + "\n")
    if not good:
        print(f"nothing to run: {len(lines) - len(todo)} lines were done already", file=sys.stderr)
        return 0
    from tqdm.auto import tqdm

    from engine import LLM

    llm = LLM(args.model, **engine_flags.given(args))
    progress = tqdm(
        total=len(lines),
        initial=len(lines) - len(good),
        desc="batch",
        unit="req",
        dynamic_ncols=True,
    )
    try:
        with args.output.open("a", encoding="utf-8") as out, errors_path.open("a") as errors:
            for start in range(0, len(good), CHUNK_LINES):
                chunk = good[start : start + CHUNK_LINES]
                for ok, text in _generate(llm, chunk):
                    (out if ok else errors).write(text + "\n")
                out.flush()
                errors.flush()
                progress.update(len(chunk))
    except KeyboardInterrupt:
        progress.close()
        print("\ninterrupted: run the same command again to resume", file=sys.stderr)
        return 130
    progress.close()
    return 0


def _generate(llm: Any, chunk: list[Any]) -> list[tuple[bool, str]]:
    """Output lines of one chunk, in order; a line the engine refuses goes to the errors."""
    from producer_api.batches.lines import line_not_run

    prompts, params, kept, results = [], [], [], []
    for line in chunk:
        request = line.request
        try:
            if request.messages is not None:
                messages = [m.model_dump(exclude_none=True) for m in request.messages]
                prompts.append(llm.engine.apply_chat_template(messages))
            else:
                prompts.append(
                    request.prompt if request.prompt is not None else list(request.prompt_token_ids)
                )
            params.append(request.sampling)
            kept.append(line)
        except Exception as exc:  # a template or tokenizer refusal belongs to this line only
            results.append((line.number, (False, line_not_run(line, "invalid_request", str(exc)))))
    if kept:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for line, output in zip(kept, outputs, strict=True):
            results.append((line.number, (True, _output_line(line, output))))
    return [item for _, item in sorted(results, key=lambda pair: pair[0])]


def _output_line(line: Any, output: RequestOutput) -> str:
    from producer_api.batches.lines import response_body
    from schemas import Job, JobStatus, Timings, utc_now
    from schemas.batches import output_line
    from worker.results import job_result

    now = utc_now()
    result = job_result(output, Timings.from_times(now, now, now, now))
    job = Job.new(line.request).model_copy(update={"status": JobStatus.SUCCEEDED, "result": result})
    return output_line(line.custom_id, job.id, response_body(line.openai, job))


def _is_done(line: Any, done: set[str]) -> bool:
    """Output lines count by custom_id; error lines by input line number (a bad line may
    repeat the custom_id of a good one)."""
    return f"line:{line.number}" in done or (line.ok and f"id:{line.custom_id}" in done)


def _finished(path: Path) -> set[str]:
    """What `path` holds already: `id:<custom_id>` per output line, `line:<n>` per error line.
    A last line cut off (the process was killed while writing) is dropped: it runs again."""
    if not path.exists():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    keys = set()
    for raw in text.splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        error = record.get("error")
        if error and error.get("line") is not None:
            keys.add(f"line:{error['line']}")
        elif record.get("custom_id") is not None:
            keys.add(f"id:{record['custom_id']}")
    return keys

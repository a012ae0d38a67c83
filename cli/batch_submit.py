"""`inferq batch submit FILE.jsonl [--wait] [-o OUT.jsonl]`: upload, create the batch, and
(with --wait) follow it with a progress bar until it ends, then download its files.

Talks to the API over HTTP only, like any other client."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cli.addresses import api_base_url
from cli.flags import SettingsFlags, add_settings_arguments, same_setting
from producer_api.settings import ApiSettings
from schemas.batches import BATCH_ENDPOINTS

HTTP_TIMEOUT = httpx.Timeout(120.0, connect=10.0)


class SubmitSettings(BaseSettings):
    """Where the API answers and the key to use; unset, the API `inferq up` or `inferq api`
    serves with the same INFERQ_HOST / INFERQ_PORT."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="ignore", populate_by_name=True)

    api_url: str | None = Field(
        None, description="the API's base URL (default: http://$INFERQ_HOST:$INFERQ_PORT)"
    )
    api_key: str | None = Field(
        None,
        validation_alias=AliasChoices("INFERQ_API_KEY", "OPENAI_API_KEY"),
        description="API key (OPENAI_API_KEY works too)",
    )
    host: str = same_setting(ApiSettings, "host")
    port: int = same_setting(ApiSettings, "port")

    def base_url(self) -> str:
        return self.api_url or api_base_url(self.host, self.port)


class SubmitError(Exception):
    """Why the submission failed, in one line."""


def add_submit_arguments(parser: argparse.ArgumentParser) -> SettingsFlags[SubmitSettings]:
    add = parser.add_argument
    add("file", type=Path, help="JSONL input: one OpenAI batch request per line")
    add("--wait", action="store_true", help="follow the batch until it ends")
    add("-o", "--output", type=Path, help="where the output file goes (implies --wait)")
    add("--errors", type=Path, help="where the error file goes (default: OUTPUT.errors.jsonl)")
    add("--endpoint", choices=BATCH_ENDPOINTS, help="default: the first line's url")
    add("--completion-window", default="24h", help="default: %(default)s")
    add("--poll", type=float, default=1.0, help="seconds between status reads")
    # the API's address: flags, else the variables `inferq up` and `inferq api` read
    return add_settings_arguments(parser, SubmitSettings, exclude=("host", "port"))


def run_submit(settings: SubmitSettings, args: argparse.Namespace) -> int:
    """Submit (and follow); every failure is one line on stderr naming what was tried."""
    api_url = settings.base_url()
    try:
        return _submit(api_url, settings.api_key, args)
    except SubmitError as exc:
        problem = str(exc)
    except httpx.TransportError as exc:
        problem = (
            f"no API answers at {api_url} ({type(exc).__name__}: {exc}); start one with "
            "`inferq up`, or pass --api-url / set INFERQ_API_URL"
        )
    except httpx.HTTPStatusError as exc:
        problem = f"{exc.request.method} {exc.request.url} answered {exc.response.status_code}"
    except httpx.InvalidURL as exc:
        problem = f"bad API URL {api_url!r}: {exc}"
    print(f"inferq batch submit: error: {problem}", file=sys.stderr)
    return 2


def _submit(api_url: str, api_key: str | None, args: argparse.Namespace) -> int:
    try:
        raw = args.file.read_bytes()
    except OSError as exc:
        raise SubmitError(f"cannot read {args.file}: {exc.strerror}") from exc
    endpoint = args.endpoint or _first_url(raw)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=api_url, headers=headers, timeout=HTTP_TIMEOUT) as http:
        uploaded = http.post(
            "/v1/files", files={"file": (args.file.name, raw)}, data={"purpose": "batch"}
        )
        if uploaded.status_code != 200:
            raise _failed("upload", uploaded)
        file_id = _field(uploaded, "id", api_url)
        note = uploaded.json().get("status_details")
        if note:
            print(f"note: {note}", file=sys.stderr)
        created = http.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": endpoint,
                "completion_window": args.completion_window,
            },
        )
        if created.status_code != 200:
            raise _failed("create batch", created)
        batch_id = _field(created, "id", api_url)
        print(batch_id, flush=True)
        if not (args.wait or args.output):
            return 0
        try:
            batch = _follow(http, batch_id, args.poll)
        except KeyboardInterrupt:
            print(
                f"\ninferq batch submit: stopped following {batch_id}; it goes on "
                f"({api_url}/v1/batches/{batch_id})",
                file=sys.stderr,
            )
            return 130
        print(
            f"{batch['id']}: {batch['status']}, {batch['request_counts']['completed']} completed, "
            f"{batch['request_counts']['failed']} failed",
            file=sys.stderr,
        )
        if args.output:
            _download(http, batch.get("output_file_id"), args.output)
            errors = args.errors or args.output.with_suffix(".errors.jsonl")
            _download(http, batch.get("error_file_id"), errors)
        return 0 if batch["status"] == "completed" else 1


def _field(response: httpx.Response, name: str, api_url: str) -> str:
    """`name` of a JSON answer; anything else means something other than inferq answered."""
    try:
        return str(response.json()[name])
    except (ValueError, KeyError, TypeError) as exc:
        raise SubmitError(
            f"{response.request.method} {response.request.url} answered without a {name!r}: "
            f"is {api_url} the inferq API?"
        ) from exc


def _follow(http: httpx.Client, batch_id: str, poll: float) -> dict:
    from tqdm.auto import tqdm

    progress = tqdm(desc=batch_id, unit="req", dynamic_ncols=True)
    try:
        while True:
            response = http.get(f"/v1/batches/{batch_id}")
            response.raise_for_status()
            batch = response.json()
            counts = batch["request_counts"]
            progress.total = counts["total"] or None
            progress.n = counts["completed"] + counts["failed"]
            progress.set_postfix(
                status=batch["status"], done=counts["completed"], failed=counts["failed"]
            )
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return batch
            time.sleep(poll)
    finally:
        progress.close()


def _download(http: httpx.Client, file_id: str | None, path: Path) -> None:
    if file_id is None:
        return
    response = http.get(f"/v1/files/{file_id}/content")
    response.raise_for_status()
    path.write_bytes(response.content)
    print(f"wrote {path}", file=sys.stderr)


def _first_url(raw: bytes) -> str:
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            url = json.loads(line).get("url")
        except (ValueError, AttributeError):
            continue
        if url in BATCH_ENDPOINTS:
            return url
    return BATCH_ENDPOINTS[0]


def _failed(what: str, response: httpx.Response) -> SubmitError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    where = f"{response.request.method} {response.request.url}"
    return SubmitError(f"{what} failed ({where}: {response.status_code}): {message}")

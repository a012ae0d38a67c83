"""`inferq batch submit FILE.jsonl [--wait] [-o OUT.jsonl]`: upload, create the batch, and
(with --wait) follow it with a progress bar until it ends, then download its files.

Talks to the API over HTTP only, like any other client."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

from schemas.batches import BATCH_ENDPOINTS

DEFAULT_API_URL = "http://127.0.0.1:8000"


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("file", type=Path, help="JSONL input: one OpenAI batch request per line")
    add("--wait", action="store_true", help="follow the batch until it ends")
    add("-o", "--output", type=Path, help="where the output file goes (implies --wait)")
    add("--errors", type=Path, help="where the error file goes (default: OUTPUT.errors.jsonl)")
    add("--endpoint", choices=BATCH_ENDPOINTS, help="default: the first line's url")
    add("--completion-window", default="24h")
    add("--api-url", default=os.environ.get("INFERQ_API_URL", DEFAULT_API_URL))
    add(
        "--api-key",
        default=os.environ.get("INFERQ_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="default: $INFERQ_API_KEY or $OPENAI_API_KEY",
    )
    add("--poll", type=float, default=1.0, help="seconds between status reads")


def run_submit(args: argparse.Namespace) -> int:
    raw = args.file.read_bytes()
    endpoint = args.endpoint or _first_url(raw)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.api_url, headers=headers, timeout=120) as http:
        uploaded = http.post(
            "/v1/files", files={"file": (args.file.name, raw)}, data={"purpose": "batch"}
        )
        if uploaded.status_code != 200:
            return _fail("upload", uploaded)
        note = uploaded.json().get("status_details")
        if note:
            print(f"note: {note}", file=sys.stderr)
        created = http.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": endpoint,
                "completion_window": args.completion_window,
            },
        )
        if created.status_code != 200:
            return _fail("create batch", created)
        batch = created.json()
        print(batch["id"])
        if not (args.wait or args.output):
            return 0
        batch = _follow(http, batch["id"], args.poll)
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


def _fail(what: str, response: httpx.Response) -> int:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    print(f"error: {what} failed ({response.status_code}): {message}", file=sys.stderr)
    return 2

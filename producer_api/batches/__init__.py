"""Bulk work: OpenAI-compatible Files and Batch API, with arq as the batch controller.

files.py     file store in Redis (size-limited) and upload validation
lines.py     input lines -> job requests, finished jobs -> output / error lines
store.py     the batch hash: create, read, status changes, listing
runner.py    one controller run over a batch: fan-out throttled by the bulk backlog, collect,
             finalize (the arq job calls it)
controller.py the arq WorkerSettings (`arq producer_api.batches.controller.WorkerSettings`)
routes.py    /v1/files and /v1/batches
"""

"""The `inferq` command line: a thin layer above the five packages.

It may import schemas, kernels, engine, worker and producer_api; none of them imports it. It
parses flags derived from the settings models (cli.flags) and calls each package's `run_*`
entry points; the local process supervisor (`inferq up`), the status CLI and the batch CLI
live here, not in the package backend apps import for the client."""

"""CLI test fixtures: `inferq batch submit` runs against the batch tests' stack (API, batch
controller and fake-engine workers)."""

from tests.batch.conftest import batch_stack, controller_env

__all__ = ["batch_stack", "controller_env"]

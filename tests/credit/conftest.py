"""The credit tests reuse the warehouse's converted episode (hand-built events, the tiny model's
real processor) for replayed successes."""

from tests.warehouse.conftest import images as images  # noqa: F401  (a fixture)
from tests.warehouse.conftest import processor as processor  # noqa: F401  (a fixture)

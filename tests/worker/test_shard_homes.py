"""How a model's workers split a cluster's shards into homes: every shard has a home worker,
and the shards are spread as evenly as the counts allow."""

from __future__ import annotations

from collections import Counter

import pytest

from worker.shard_homes import home_shards


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 7, 12])
@pytest.mark.parametrize("shards", [1, 3, 4, 6])
def test_every_shard_is_home_to_about_as_many_workers_as_any_other(workers, shards):
    homes = [home_shards(i, workers, shards) for i in range(workers)]
    per_shard = Counter(shard for home in homes for shard in home)
    assert set(per_shard) == set(range(shards))  # none left to the leftovers alone
    assert max(per_shard.values()) - min(per_shard.values()) <= 1
    assert all(home and home <= set(range(shards)) for home in homes)
    # a worker has one home shard when there are enough workers, else an even share
    assert max(len(home) for home in homes) == max(1, -(-shards // workers))

"""Which continuations a beam search step keeps, on hand-made logprob rows (no model)."""

from __future__ import annotations

import torch

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from engine.sequence import Sequence

EOS_TOKEN_IDS = frozenset({3, 4})
LOW = -9.0  # a continuation no step ranks high


def _step(scheduler: Scheduler, search: BeamSearch, rows: list[list[float]]) -> None:
    """One model step for the live beams, in their order, with the given logprob rows."""
    out = scheduler.schedule()
    scheduler.update_after_step(out)
    beams = [beam.seq for beam in search.live]
    assert {item.seq for item in out.scheduled} == set(beams)
    search.advance(dict(zip(beams, map(torch.tensor, rows), strict=True)), scheduler)


def test_beams_go_on_when_each_beams_best_continuations_end() -> None:
    """Like transformers, a step ranks (1 + number of EOS ids) x width continuations, not
    2 x width: with two EOS ids and width 2, six. Here ranks 2 to 4 end, so only the sixth
    keeps a second beam alive."""
    config = EngineConfig(model="dummy", block_size=4, num_kv_blocks=16)
    scheduler = Scheduler(config, BlockManager(16, 4, enable_prefix_caching=False))
    params = BeamSearchParams(beam_width=2, max_tokens=8).to_sampling_params()
    first = Sequence("beams", [0, 1, 2], 3, params)
    scheduler.add(first)
    search = BeamSearch(first, EOS_TOKEN_IDS, max_model_len=64, decode=None)

    _step(scheduler, search, [[-0.5, -1.0, LOW, LOW, LOW]])
    assert [beam.seq.output_token_ids for beam in search.live] == [[0], [1]]

    # Cumulative: [0]+3 -0.6, [0]+0 -0.7, [0]+4 -0.8, [1]+3 -1.05, [1]+4 -1.06, [1]+2 -1.07.
    _step(
        scheduler,
        search,
        [[-0.2, LOW, LOW, -0.1, -0.3], [LOW, LOW, -0.07, -0.05, -0.06]],
    )
    assert [h.token_ids for h in search.finished] == [[0, 3]]
    assert [beam.seq.output_token_ids for beam in search.live] == [[0, 0], [1, 2]]
    assert not search.done

"""Token-based stop checks (engine.stop) and the scheduler finishing what they stop."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.stop import Stop, StopRules, append_until_stop, check_stop
from schemas.sampling import SamplingParams

EOS = 2
RULES = StopRules.of({EOS}, max_model_len=20)


def seq_of(prompt_len: int = 4, **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    return Sequence("r", list(range(10, 10 + prompt_len)), prompt_len, SamplingParams(**params))


def after(seq: Sequence, *tokens: int) -> Stop | None:
    for token in tokens:
        seq.append_token(token)
    return check_stop(seq, RULES)


def test_eos_stops_unless_ignore_eos():
    assert after(seq_of(), 50, EOS) == Stop("stop", None)
    assert after(seq_of(ignore_eos=True), 50, EOS) is None


def test_stop_token_ids_stop_and_name_the_token():
    assert after(seq_of(stop_token_ids=[7]), 50, 7) == Stop("stop", 7)
    assert after(seq_of(stop_token_ids=[EOS]), EOS) == Stop("stop", EOS)


@pytest.mark.parametrize("token", [EOS, 7])
def test_stop_tokens_count_only_from_min_tokens(token):
    params = dict(min_tokens=3, stop_token_ids=[7])
    assert after(seq_of(**params), 50, token) is None
    assert after(seq_of(**params), 50, 51, token) is not None


def test_max_tokens_and_max_model_len_stop_with_length():
    assert after(seq_of(max_tokens=2), 50) is None
    assert after(seq_of(max_tokens=2), 50, 51) == Stop("length")
    prompt_len = RULES.max_model_len - 2
    assert after(seq_of(prompt_len), 50, 51) == Stop("length")


def test_a_stop_token_on_the_length_limit_reports_stop():
    assert after(seq_of(max_tokens=2, stop_token_ids=[7]), 50, 7) == Stop("stop", 7)


def test_append_until_stop_appends_up_to_the_first_stop():
    seq = seq_of(stop_token_ids=[7])
    assert append_until_stop(seq, [50, 7, 51, 52], RULES) == Stop("stop", 7)
    assert seq.output_token_ids == [50, 7]
    seq = seq_of()
    assert append_until_stop(seq, [50, 51], RULES) is None
    assert seq.output_token_ids == [50, 51]


def test_the_scheduler_finishes_what_its_sampled_tokens_stop_and_frees_the_blocks():
    config = EngineConfig(model="dummy", block_size=4, num_kv_blocks=16)
    bm = BlockManager(16, 4, True)
    sched = Scheduler(config, bm, RULES)
    going, stopping = seq_of(), seq_of(stop_token_ids=[7])
    for seq in (going, stopping):
        sched.add(seq)
    out = sched.schedule()
    sched.update_after_step(out)
    stops = sched.append_sampled([going, stopping], [50, 7])
    assert stops == [None, Stop("stop", 7)]
    assert going.status is SequenceStatus.RUNNING
    assert stopping.is_finished
    assert (stopping.finish_reason, stopping.stop_reason) == ("stop", 7)
    assert stopping.block_table == []
    assert sched.running == [going]

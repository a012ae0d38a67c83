"""Sampler behaviour against brute-force oracles computed in float64 from the definitions."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampler import Sampler, argmax
from engine.sequence import Sequence
from schemas.sampling import SamplingParams

VOCAB = 64
EOS = 3
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def make_seq(
    prompt: list[int] | None = None, output: list[int] | None = None, **params
) -> Sequence:
    prompt = [5, 6, 7] if prompt is None else prompt
    output = output or []
    return Sequence(
        request_id="r",
        token_ids=list(prompt) + list(output),
        num_prompt_tokens=len(prompt),
        params=SamplingParams(max_tokens=1000, **params),
    )


def make_choice(choice_index: int, **params) -> Sequence:
    seq = make_seq(**params)
    seq.choice_index = choice_index
    return seq


@pytest.fixture(autouse=True)
def _deterministic_global_rng():
    torch.manual_seed(0)


# ---------------------------------------------------------------- oracles


def allowed_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    eps: float = 1e-4,
) -> tuple[set[int], set[int], dict[int, float]]:
    """(surely allowed, borderline, target distribution) from the definitions, in float64.

    top-k keeps the k largest; top-p then keeps a token while the mass ranked above it (under
    the renormalised top-k survivors) is below p; min-p keeps tokens with prob >= min_p x max.
    Tokens within eps of a threshold are borderline: float32 rounding may go either way.
    """
    scaled = [float(x) / temperature for x in logits.double()]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    sure, border = set(order), set()
    if 0 < top_k < len(scaled):
        sure = set(order[:top_k])
    if top_p < 1.0:
        kept = [t for t in order if t in sure]
        top = scaled[kept[0]]
        weights = [math.exp(scaled[t] - top) for t in kept]
        total = sum(weights)
        above = 0.0
        survivors = set()
        for t, w in zip(kept, weights, strict=True):
            if above < top_p - eps:
                survivors.add(t)
            elif above < top_p + eps:
                border.add(t)
            above += w / total
        sure = survivors
    if min_p > 0.0:
        top = max(scaled)
        cut = top + math.log(min_p)
        border |= {t for t in sure | border if abs(scaled[t] - cut) < eps}
        sure = {t for t in sure if scaled[t] >= cut + eps}
        border = {t for t in border if scaled[t] >= cut - eps}
    border -= sure
    top = max(scaled[t] for t in sure)
    weights = {t: math.exp(scaled[t] - top) for t in sure}
    total = sum(weights.values())
    return sure, border, {t: w / total for t, w in weights.items()}


def reference_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Row-by-row, token-by-token penalties exactly as the definitions read."""
    out = logits.double().clone()
    p = seq.params
    for token in set(seq.prompt_token_ids) | set(seq.output_token_ids):
        if out[token] > 0:
            out[token] /= p.repetition_penalty
        else:
            out[token] *= p.repetition_penalty
    for token, count in Counter(seq.output_token_ids).items():
        out[token] -= p.frequency_penalty * count
        out[token] -= p.presence_penalty
    return out


# ---------------------------------------------------------------- greedy and filters


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_argmax_alone_and_next_to_sampled_rows(device):
    logits = torch.randn(6, VOCAB, device=device)
    sampler = Sampler(VOCAB, {EOS}, device)
    greedy = [make_seq(temperature=0.0) for _ in range(6)]
    assert sampler(logits, greedy).token_ids == logits.argmax(-1).tolist()

    mixed = [make_seq(temperature=0.0 if row % 2 else 1.0, top_k=5) for row in range(6)]
    picked = sampler(logits, mixed).token_ids
    for row in range(1, 6, 2):
        assert picked[row] == int(logits[row].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_vocab_columns_are_never_sampled(dtype):
    logits = torch.randn(4, VOCAB + 8).to(dtype)
    logits[:, VOCAB:] = 100.0  # LM-head padding that would dominate if it were not cut off
    sampler = Sampler(VOCAB, {EOS})
    seqs = [make_seq(temperature=0.0), make_seq(), make_seq(top_p=0.5), make_seq(top_k=3)]
    assert all(t < VOCAB for t in sampler(logits, seqs).token_ids)
    greedy = [make_seq(temperature=0.0) for _ in range(4)]
    expected = logits[:, :VOCAB].float().argmax(-1).tolist()
    assert sampler(logits, greedy).token_ids == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_argmax_picks_the_first_maximum_like_torch(dtype, width):
    rows = torch.randn(7, width + 5).to(dtype)[:, :width]  # rows of a wider tensor
    rows[1] = -math.inf
    rows[2] = 0.0  # all tied: the first wins
    rows[3, width // 2 :] = 50.0  # tied maxima in different vector lanes
    if width > 16:
        rows[4, 3] = rows[4, width - 1] = 60.0
    rows[5, width // 3] = math.nan  # a NaN wins, as in torch
    rows[6, width - 1] = 70.0  # the tail past the last full vector
    assert argmax(rows).tolist() == rows.argmax(-1).tolist()


FILTER_CASES = [
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_p=0.6),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=1.0, top_k=10, top_p=0.7),
    dict(temperature=0.5, top_k=12, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.05),  # only the top token survives
    dict(temperature=1.8),
]


@pytest.mark.parametrize(
    "case", FILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize("device", DEVICES)
def test_filters_emit_only_allowed_tokens_with_the_filtered_distribution(case, device):
    logits = torch.randn(VOCAB)  # flat enough that every filter keeps several tokens
    sure, border, target = allowed_tokens(
        logits,
        case["temperature"],
        case.get("top_k", -1),
        case.get("top_p", 1.0),
        case.get("min_p", 0.0),
    )
    draws = 4000
    seqs = [make_seq(**case) for _ in range(draws)]
    batch_logits = logits.expand(draws, VOCAB).contiguous().to(device)
    picked = Sampler(VOCAB, {EOS}, device)(batch_logits, seqs).token_ids
    assert set(picked) <= sure | border
    # Too strict a filter would miss allowed tokens: each one likely enough must turn up.
    assert {t for t, prob in target.items() if prob > 0.005} <= set(picked)
    if not border:
        # Empirical distribution vs the renormalised filtered softmax (total variation).
        counts = Counter(picked)
        tv = 0.5 * sum(abs(counts.get(t, 0) / draws - target.get(t, 0.0)) for t in sure)
        assert tv < 0.06, tv


@pytest.mark.parametrize("device", DEVICES)
def test_filters_mixed_per_row_in_one_batch(device):
    """Each row's filters apply to that row only."""
    cases = FILTER_CASES * 40
    logits = torch.randn(len(cases), VOCAB) * 2.0
    seqs = [make_seq(**case) for case in cases]
    picked = Sampler(VOCAB, {EOS}, device)(logits.to(device), seqs).token_ids
    for row, case in enumerate(cases):
        sure, border, _ = allowed_tokens(
            logits[row],
            case["temperature"],
            case.get("top_k", -1),
            case.get("top_p", 1.0),
            case.get("min_p", 0.0),
        )
        assert picked[row] in sure | border


# ---------------------------------------------------------------- penalties and min_tokens


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference_implementation(device):
    rng = torch.Generator().manual_seed(1)
    settings = [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8, frequency_penalty=0.5),
        dict(presence_penalty=-1.2),
        dict(frequency_penalty=1.5, presence_penalty=0.7, repetition_penalty=1.9),
        dict(),  # no penalty: untouched even next to penalised rows
        dict(temperature=0.0, frequency_penalty=-0.4),
    ]
    seqs = []
    for setting in settings:
        prompt = torch.randint(0, VOCAB, (20,), generator=rng).tolist()
        output = torch.randint(0, VOCAB, (15,), generator=rng).tolist()
        seqs.append(make_seq(prompt, output, **setting))
    logits = torch.randn(len(seqs), VOCAB, generator=rng) * 3
    original = logits.clone()

    processed = Sampler(VOCAB, {EOS}, device).process_logits(logits.to(device), seqs).cpu()

    assert torch.equal(logits, original)  # the caller's logits are not modified
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(processed[row].double(), reference_penalties(logits[row], seq))


def test_penalties_steer_greedy_choice_like_the_reference():
    rng = torch.Generator().manual_seed(2)
    seqs = []
    for _ in range(16):
        output = torch.randint(0, 8, (10,), generator=rng).tolist()  # heavy repeats
        seqs.append(
            make_seq([1, 2], output, temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.5)
        )
    logits = torch.randn(len(seqs), VOCAB, generator=rng)
    picked = Sampler(VOCAB, {EOS})(logits, seqs).token_ids
    expected = [int(reference_penalties(logits[r], s).argmax()) for r, s in enumerate(seqs)]
    assert picked == expected


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    stop_id = 9
    logits = torch.randn(1, VOCAB)
    logits[0, EOS] = 50.0
    logits[0, stop_id] = 49.0
    sampler = Sampler(VOCAB, {EOS})
    for temperature in (0.0, 1.0):
        for produced in range(4):
            seq = make_seq(
                output=[11] * produced,
                min_tokens=3,
                stop_token_ids=[stop_id],
                temperature=temperature,
            )
            batch = [seq] * 64
            picked = set(sampler(logits.expand(64, VOCAB), batch).token_ids)
            if produced < 3:
                assert picked.isdisjoint({EOS, stop_id})
            elif temperature == 0.0:
                assert picked == {EOS}


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_log_softmax_of_raw_logits(device):
    logits = torch.randn(5, VOCAB) * 3
    seqs = [
        make_seq(
            logprobs=True, top_logprobs=4, temperature=0.0, repetition_penalty=1.8, output=[1, 2]
        ),
        make_seq(),  # no logprobs asked
        make_seq(logprobs=True, temperature=0.3, top_k=3, min_tokens=2),
        make_seq(logprobs=True, top_logprobs=1, frequency_penalty=1.0, output=[4, 4]),
        make_seq(logprobs=True, top_logprobs=20, top_p=0.5),
    ]
    out = Sampler(VOCAB, {EOS}, device)(logits.to(device), seqs)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, seq in enumerate(seqs):
        if not seq.params.logprobs:
            assert out.logprobs[row] is None and out.top_logprobs[row] is None
            continue
        assert out.logprobs[row] == pytest.approx(
            float(reference[row, out.token_ids[row]]), abs=1e-5
        )
        k = seq.params.top_logprobs
        if k == 0:
            assert out.top_logprobs[row] is None
            continue
        values, ids = reference[row].topk(k)
        assert [t for t, _ in out.top_logprobs[row]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-5)


# ---------------------------------------------------------------- seeds


def fake_model_logits(seqs: list[Sequence], vocab: int = VOCAB) -> torch.Tensor:
    """Logits that depend only on each sequence's own tokens, like a real model."""
    rows = []
    for seq in seqs:
        generator = torch.Generator().manual_seed(hash(tuple(seq.token_ids)) % (2**62))
        rows.append(torch.randn(vocab, generator=generator) * 1.5)
    return torch.stack(rows)


def run_steps(sampler: Sampler, batch: list[Sequence], steps: int) -> None:
    for _ in range(steps):
        out = sampler(fake_model_logits(batch).to(sampler.device), batch)
        for seq, token in zip(batch, out.token_ids, strict=True):
            seq.append_token(token)


def random_neighbours(count: int, rng: torch.Generator) -> list[Sequence]:
    kinds = [
        dict(),
        dict(temperature=0.0),
        dict(seed=7, top_p=0.8),
        dict(top_k=4, repetition_penalty=1.2),
        dict(seed=1234, temperature=0.5),  # same seed, other request: own stream
        dict(logprobs=True, min_p=0.1),
    ]
    out = []
    for _ in range(count):
        kind = kinds[int(torch.randint(len(kinds), (1,), generator=rng))]
        prompt = torch.randint(
            0, VOCAB, (int(torch.randint(1, 9, (1,), generator=rng)),), generator=rng
        )
        out.append(make_seq(prompt.tolist(), **kind))
    return out


SEEDED = dict(seed=1234, temperature=1.0, top_p=0.95)
STEPS = 8


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_gives_same_tokens_alone_and_in_any_batch(device):
    alone = make_seq(**SEEDED)
    run_steps(Sampler(VOCAB, {EOS}, device), [alone], STEPS)
    rng = torch.Generator().manual_seed(3)
    for batch_size, position in [(2, 0), (5, 3), (9, 8), (16, 6)]:
        others = random_neighbours(batch_size - 1, rng)
        seq = make_seq(**SEEDED)
        batch = [*others[:position], seq, *others[position:]]
        run_steps(Sampler(VOCAB, {EOS}, device), batch, STEPS)
        assert seq.output_token_ids == alone.output_token_ids


def test_different_seeds_and_choices_give_different_streams():
    streams = {}
    for seed, choice in [(1, 0), (2, 0), (1, 1), (1, 2)]:
        seq = make_choice(choice, seed=seed, temperature=1.0)
        run_steps(Sampler(VOCAB, {EOS}), [seq], 12)
        streams[(seed, choice)] = tuple(seq.output_token_ids)
    assert len(set(streams.values())) == len(streams)
    again = make_choice(1, seed=1, temperature=1.0)
    run_steps(Sampler(VOCAB, {EOS}), [again], 12)
    assert tuple(again.output_token_ids) == streams[(1, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_resumed_seeded_sequence_continues_the_same_stream(device):
    full = make_seq(**SEEDED)
    run_steps(Sampler(VOCAB, {EOS}, device), [full], 10)
    done = 4
    resumed = make_seq(output=full.output_token_ids[:done], **SEEDED)  # fresh seq_id, fresh sampler
    neighbours = random_neighbours(3, torch.Generator().manual_seed(4))
    run_steps(Sampler(VOCAB, {EOS}, device), [*neighbours, resumed], 10 - done)
    assert resumed.output_token_ids == full.output_token_ids


def test_the_stream_lives_on_the_sequence_and_a_new_sequence_starts_over():
    sampler = Sampler(VOCAB, {EOS})
    seq = make_seq(**SEEDED)
    run_steps(sampler, [seq], 3)
    first = list(seq.output_token_ids)
    assert seq.sampler_state.generator is not None  # the sampler itself keeps nothing
    again = make_seq(**SEEDED)  # a new sequence of the same seed: a fresh stream from the seed
    run_steps(sampler, [again], 3)
    assert again.output_token_ids == first

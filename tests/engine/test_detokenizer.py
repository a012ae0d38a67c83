"""Incremental detokenization and stop conditions, checked against tokenizer.decode and a
character-level stop-string oracle. Tokens go through the stop checks (engine.stop) and the
detokenizer the way the engine feeds them."""

from __future__ import annotations

import json
import random

import pytest

from engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, TextDelta
from engine.sequence import Sequence
from engine.stop import StopRules, append_until_stop
from schemas.sampling import SamplingParams

TEXTS = [
    "Hello 😀 world 🎉!",
    "日本語のテキストと中文文本。",
    "family: 👩‍👩‍👧 flags 🇯🇵🇫🇷 done",
    "naïve café — Ωμέγα, привет, 한국어 text",
    "a😀b😀😀c 中",
]
CORPUS = [
    "Hello world, this is a tiny corpus.",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文文本。",
    "emoji 😀🎉 mixed with text",
] * 4


@pytest.fixture(scope="module")
def smol(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def tiny_bpe():
    """A small byte-level BPE trained here: most non-ASCII characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """Metaspace BPE with byte fallback and a leading-space-stripping decoder (Llama/Mistral)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator([t.replace(" ", "▁") for t in CORPUS if t.isascii()], trainer)
    spec = json.loads(tokenizer.to_str())
    for byte in range(256):  # byte-fallback pieces for everything the corpus lacked
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")


@pytest.fixture(params=["smol", "tiny_bpe"])
def byte_level(request):
    if request.param == "smol":
        request.applymarker(pytest.mark.model)
    return request.getfixturevalue(request.param)


class StoppingDetokenizer:
    """One sequence's token stop checks and its text, fed as the engine feeds them: each batch
    of tokens is appended up to the first that stops the sequence, then detokenized."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, rules: StopRules):
        self.seq = Sequence("r", list(prompt_ids), len(prompt_ids), params)
        self.rules = rules
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)

    def add_tokens(self, ids: list[int]) -> TextDelta:
        if self.detok.finished:
            return self.detok.add_tokens(ids)
        before = self.seq.num_output_tokens
        stop = append_until_stop(self.seq, ids, self.rules)
        return self.detok.add_tokens(ids[: self.seq.num_output_tokens - before], stop)

    @property
    def output_text(self) -> str:
        return self.detok.output_text

    @property
    def num_output_tokens(self) -> int:
        return self.detok.num_output_tokens


def detokenizer(tokenizer, prompt="Answer: ", max_model_len=100_000, prompt_ids=None, **params):
    params.setdefault("max_tokens", 10_000)
    if prompt_ids is None:
        prompt_ids = encode(tokenizer, prompt)
    rules = StopRules.of({tokenizer.eos_token_id}, max_model_len)
    return StoppingDetokenizer(tokenizer, prompt_ids, SamplingParams(**params), rules)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: StoppingDetokenizer, ids: list[int], chunk: int = 1) -> list[TextDelta]:
    deltas = []
    for start in range(0, len(ids), chunk):
        deltas.append(detok.add_tokens(ids[start : start + chunk]))
        if deltas[-1].finish_reason:
            break
    return deltas


def joined(deltas: list[TextDelta]) -> str:
    return "".join(delta.text for delta in deltas)


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_tokenizer_decode(byte_level, text, chunk):
    ids = encode(byte_level, text)
    detok = detokenizer(byte_level)
    deltas = stream(detok, ids, chunk)
    assert joined(deltas) == byte_level.decode(ids, skip_special_tokens=True)
    assert detok.output_text == joined(deltas)
    # A token ending inside a character yields nothing until the character completes.
    assert all("\ufffd" not in delta.text for delta in deltas)
    assert all(delta.finish_reason is None for delta in deltas)


def test_multibyte_characters_are_split_across_tokens_in_these_cases(byte_level):
    """Guards the test above: it must exercise tokens that end mid-character."""
    pieces = [byte_level.decode([i]) for i in encode(byte_level, "".join(TEXTS))]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("seed", range(4))
def test_random_token_ids_decode_like_the_tokenizer(byte_level, seed):
    """Arbitrary ids give arbitrary (even invalid) UTF-8; the finish flushes what is pending."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(byte_level)) for _ in range(60)]
    eos = byte_level.eos_token_id
    ids = [i for i in ids if i != eos]
    deltas = stream(detokenizer(byte_level, max_tokens=len(ids)), ids)
    assert deltas[-1].finish_reason == "length"
    assert joined(deltas) == byte_level.decode(ids, skip_special_tokens=True)


@pytest.mark.model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(smol, skip_special_tokens):
    ids = [
        *encode(smol, "Hi 😀"),
        smol.convert_tokens_to_ids("<|im_start|>"),
        *encode(smol, "user 世界"),
    ]
    detok = detokenizer(smol, skip_special_tokens=skip_special_tokens)
    assert joined(stream(detok, ids)) == smol.decode(ids, skip_special_tokens=skip_special_tokens)


def test_sentencepiece_style_output_reads_in_the_context_of_its_prompt(sentencepiece_like):
    tok = sentencepiece_like
    prompt_ids = encode(tok, "The quick brown")
    for text in ["fox jumps 😀 over", "日本 the dog"]:
        ids = encode(tok, text)
        deltas = stream(detokenizer(tok, prompt_ids=prompt_ids), ids)
        in_context = tok.decode(prompt_ids + ids)
        assert joined(deltas) == in_context[len(tok.decode(prompt_ids)) :]
        # Without a prompt there is no context: the text is exactly decode(output ids).
        assert joined(stream(detokenizer(tok, prompt_ids=[]), ids)) == tok.decode(ids)


class CountingTokenizer:
    """Exposes only decode(), recording how many ids each call decodes."""

    def __init__(self, inner):
        self.inner = inner
        self.eos_token_id = inner.eos_token_id
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_short_window_not_the_whole_output(tiny_bpe):
    ids = encode(tiny_bpe, " ".join(TEXTS) * 4)
    counting = CountingTokenizer(tiny_bpe)
    detok = detokenizer(counting, prompt_ids=encode(tiny_bpe, "Prompt: " * 5))
    deltas = stream(detok, ids)
    assert joined(deltas) == tiny_bpe.decode(ids)
    assert len(ids) > 200
    # A window spans the last released token(s) plus the pending part of one character.
    assert max(counting.window_sizes) <= PROMPT_CONTEXT_TOKENS + 8
    assert len(counting.window_sizes) <= 2 * len(ids) + 1


# ---------------------------------------------------------------- stop strings


def oracle_emitted(text: str, stops: list[str]) -> tuple[str, str | None]:
    """(text safe to show, matched stop) with the text arriving one character at a time."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], stop
    hold = max(
        (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0
    )
    return text[: len(text) - hold], None


STOP_CASES = [
    ("The answer is 42. END of text", ["42. E"]),
    ("The answer is 42. END of text", ["ENDING", "s 4"]),
    ("abab abba ab abbab", ["abbab", "ba a"]),
    ("fox dog fox the dog the fox", ["the fox", "dog the", "xx"]),
    ("Hello 😀 world 🎉!", ["😀 wo", "world 🎉?"]),
    ("日本語のテキストと中文文本。", ["テキスト", "中文本"]),
    ("no stop here at all", ["here!", "all the"]),
    # one token completes both: the match that ends first wins, in either listing order
    ("the quick brown fox", ["e quick", "quic"]),
    ("the quick brown fox", ["quic", "e quick"]),
]


@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
def test_stop_strings_emit_exactly_what_is_safe_at_every_step(byte_level, text, stops):
    """After every token the emitted text is all decoded text minus what may begin a stop
    string, truncated before a matched stop string: nothing is ever retracted."""
    ids = encode(byte_level, text)
    detok = detokenizer(byte_level, stop=stops)
    emitted = ""
    for count, token in enumerate(ids, start=1):
        delta = detok.add_tokens([token])
        emitted += delta.text
        decoded = byte_level.decode(ids[:count])
        if decoded.endswith("\ufffd"):
            continue  # the oracle needs whole characters; the final state is checked below
        expected, matched = oracle_emitted(decoded, stops)
        assert emitted == expected
        assert delta.finish_reason == ("stop" if matched else None)
        if matched:
            assert delta.stop_reason == matched
            break
    else:
        # Unresolved held-back text stays held while the sequence runs.
        assert emitted == oracle_emitted(byte_level.decode(ids), stops)[0]


def test_stop_string_spanning_tokens_is_cut_in_any_chunking(byte_level):
    text, stop = "The answer is 42. END of text", "42. E"
    ids = encode(byte_level, text)
    assert all(stop not in byte_level.decode([i]) for i in ids)  # spans token boundaries
    for chunk in [1, 2, 3, len(ids)]:
        detok = detokenizer(byte_level, stop=[stop])
        deltas = stream(detok, ids, chunk)
        assert joined(deltas) == text[: text.index(stop)]
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
        assert detok.output_text == text[: text.index(stop)]


def test_held_back_text_is_released_when_length_finishes(byte_level):
    text = "the end is EN"
    ids = encode(byte_level, text)
    detok = detokenizer(byte_level, stop=["END"], max_tokens=len(ids))
    deltas = stream(detok, ids)
    assert not joined(deltas[:-1]).endswith("EN")  # was held back while it could become END
    assert joined(deltas) == text
    assert deltas[-1].finish_reason == "length"


def test_stop_strings_and_stop_tokens_wait_for_min_tokens(byte_level):
    ids = encode(byte_level, "fox dog fox dog")
    count_to_first_dog = next(
        n for n in range(1, len(ids) + 1) if "dog" in byte_level.decode(ids[:n])
    )
    detok = detokenizer(byte_level, stop=["dog"], min_tokens=count_to_first_dog + 1)
    deltas = stream(detok, ids)
    assert joined(deltas) == "fox dog fox "
    assert deltas[-1].stop_reason == "dog"


# ---------------------------------------------------------------- stop tokens, EOS, length


def test_stop_token_id_finishes_without_its_text(byte_level):
    ids = encode(byte_level, "the quick brown fox")
    stop_token = ids[3]
    detok = detokenizer(byte_level, stop_token_ids=[stop_token])
    delta = detok.add_tokens(ids)  # later tokens in the same call are ignored
    assert delta.text == byte_level.decode(ids[:3])
    assert (delta.finish_reason, delta.stop_reason) == ("stop", stop_token)
    assert detok.num_output_tokens == 4
    after = detok.add_tokens(ids[:1])
    assert (after.text, after.finish_reason) == ("", "stop")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_eos_stops_unless_ignore_eos(byte_level, skip_special_tokens):
    eos = byte_level.eos_token_id
    ids = [*encode(byte_level, "Hi 😀"), eos, *encode(byte_level, " more")]
    deltas = stream(detokenizer(byte_level, skip_special_tokens=skip_special_tokens), ids)
    assert joined(deltas) == byte_level.decode(ids[: ids.index(eos)])
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", None)

    detok = detokenizer(
        byte_level, ignore_eos=True, max_tokens=len(ids), skip_special_tokens=skip_special_tokens
    )
    deltas = stream(detok, ids)
    assert joined(deltas) == byte_level.decode(ids, skip_special_tokens=skip_special_tokens)
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("min_tokens", [3, 4])
def test_eos_counts_only_from_min_tokens_output_tokens(byte_level, min_tokens):
    """EOS as output token number min_tokens stops; any earlier EOS is plain (skipped) text."""
    eos = byte_level.eos_token_id
    words = encode(byte_level, "one two three four five")
    ids = [words[0], eos, words[1], eos, *words[2:], eos]
    deltas = stream(detokenizer(byte_level, min_tokens=min_tokens), ids)
    stopped_at = 4 if min_tokens <= 4 else len(ids)
    assert len(deltas) == stopped_at
    assert deltas[-1].finish_reason == "stop"
    assert joined(deltas) == byte_level.decode(ids[: stopped_at - 1], skip_special_tokens=True)


def test_max_tokens_and_max_model_len_finish_with_length(byte_level):
    ids = encode(byte_level, "the quick brown fox jumps over the lazy dog")
    deltas = stream(detokenizer(byte_level, max_tokens=5), ids)
    assert len(deltas) == 5 and deltas[-1].finish_reason == "length"
    assert joined(deltas) == byte_level.decode(ids[:5])

    prompt_ids = encode(byte_level, "a b c d e f g")
    detok = detokenizer(byte_level, prompt_ids=prompt_ids, max_model_len=len(prompt_ids) + 3)
    deltas = stream(detok, ids)
    assert len(deltas) == 3 and deltas[-1].finish_reason == "length"
    assert deltas[-1].stop_reason is None


def test_length_finish_inside_a_character_flushes_it_like_decode(byte_level):
    ids = encode(byte_level, "ok 😀😀")
    cut = next(n for n in range(1, len(ids)) if byte_level.decode(ids[:n]).endswith("\ufffd"))
    deltas = stream(detokenizer(byte_level, max_tokens=cut), ids)
    assert joined(deltas) == byte_level.decode(ids[:cut])


def test_stop_on_the_last_allowed_token_reports_stop(byte_level):
    ids = encode(byte_level, "the quick brown")
    deltas = stream(detokenizer(byte_level, max_tokens=3, stop_token_ids=[ids[2]]), ids)
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", ids[2])


# ---------------------------------------------------------------- resumed sequences


@pytest.mark.parametrize("done", [1, 4, 9])
def test_resumed_sequence_continues_the_same_text(byte_level, done):
    text = "Hello 😀 world, the END is near 日本 END"
    ids = encode(byte_level, text)
    params = dict(stop=["END is", "near 日本 E"])
    full = detokenizer(byte_level, **params)
    full_deltas = stream(full, ids)

    resumed = detokenizer(byte_level, **params)
    earlier = resumed.add_tokens(ids[:done])  # the text so far, which the caller discards
    later = stream(resumed, ids[done:])
    assert earlier.text + joined(later) == joined(full_deltas)
    assert resumed.output_text == full.output_text
    assert (later[-1].finish_reason, later[-1].stop_reason) == (
        full_deltas[-1].finish_reason,
        full_deltas[-1].stop_reason,
    )
    assert resumed.num_output_tokens == full.num_output_tokens

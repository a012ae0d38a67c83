"""The incremental tool-call parser: however the model's text is cut into chunks, the events add
up to what the whole text gives; markup never shows as content; a call's name comes first and
its arguments stream as the model writes them."""

from __future__ import annotations

import json
import random

import pytest

from producer_api.tool_call_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCall,
    ToolCallEvent,
    ToolCallParser,
    parse_whole,
)

TOOLS = {"get_weather", "get_time"}
WEATHER_ARGS = '{"city": "Rome", "unit": "F"}'
TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    f'{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET \\"winter\\" {x}"}}</tool_call>'
)


def fed(pieces: list[str], forced: bool = False) -> list[ToolCallEvent]:
    parser = ToolCallParser(TOOLS, forced)
    events = [event for piece in pieces for event in parser.feed(piece)]
    return events + parser.finish()


def folded(events: list[ToolCallEvent]) -> tuple[str, list[ParsedCall]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names = [e.name for e in events if isinstance(e, CallStart)]
    arguments = [
        "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
        for i in range(len(names))
    ]
    return content, [ParsedCall(name=n, arguments=a) for n, a in zip(names, arguments, strict=True)]


def test_a_whole_text_gives_its_content_and_calls_with_the_arguments_as_written():
    content, calls = parse_whole(TWO_CALLS, TOOLS)
    assert content == "Let me check."
    assert calls == [
        ParsedCall(name="get_weather", arguments=WEATHER_ARGS),
        ParsedCall(name="get_time", arguments='{"zone": "CET \\"winter\\" {x}"}'),
    ]
    assert json.loads(calls[1].arguments) == {"zone": 'CET "winter" {x}'}


@pytest.mark.parametrize("cut", range(1, len(TWO_CALLS)))
def test_any_cut_in_two_gives_what_the_whole_text_gives(cut):
    events = fed([TWO_CALLS[:cut], TWO_CALLS[cut:]])
    assert folded(events) == parse_whole(TWO_CALLS, TOOLS)
    assert not any("<" in e.text for e in events if isinstance(e, ContentDelta))


def test_character_by_character_and_random_cuts_give_what_the_whole_text_gives():
    rng = random.Random(3)
    whole = parse_whole(TWO_CALLS, TOOLS)
    assert folded(fed(list(TWO_CALLS))) == whole
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 12)))
        pieces = [TWO_CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(TWO_CALLS)], strict=True)]
        assert folded(fed(pieces)) == whole


def test_a_tag_split_across_chunks_is_held_back_not_shown():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Sure <tool") == [ContentDelta("Sure")]
    assert parser.feed("_call>") == []
    assert parser.feed('{"name": "get_time", ') == [CallStart(0, "get_time")]
    assert parser.feed('"arguments": {"zo') == [ArgumentsDelta(0, '{"zo')]
    assert parser.feed('ne": 1}}</tool_') == [ArgumentsDelta(0, 'ne": 1}')]
    assert parser.feed("call>") == []
    assert parser.finish() == []
    assert parser.calls == 1


def test_what_only_looked_like_a_tag_is_content():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("a <tool") == [ContentDelta("a")]
    assert parser.feed("box> <<t") == [ContentDelta(" <toolbox> <")]
    assert parser.finish() == [ContentDelta("<t")]


def test_the_name_comes_first_even_when_the_arguments_are_written_before_it():
    parser = ToolCallParser(TOOLS)
    assert parser.feed('<tool_call>{"arguments": {"city": "Oslo"}, ') == []
    assert parser.feed('"name": "get_weather"}') == [
        CallStart(0, "get_weather"),
        ArgumentsDelta(0, '{"city": "Oslo"}'),
    ]


def test_a_block_that_is_no_call_is_given_back_as_content():
    for block in (
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
    ):
        text = f"Before {block} after"
        events = fed(list(text))
        assert folded(events) == (text, [])
        assert parse_whole(text, TOOLS) == (text, [])


def test_a_call_cut_short_keeps_the_arguments_that_came():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse_whole(text, TOOLS) == (
        "",
        [ParsedCall(name="get_weather", arguments='{"city": "Pa')],
    )
    assert folded(fed(list(text))) == parse_whole(text, TOOLS)


def test_a_block_cut_short_before_its_name_is_content():
    text = 'Hmm <tool_call>{"na'
    assert parse_whole(text, TOOLS) == (text, [])


def test_a_call_without_arguments_has_an_empty_object():
    assert parse_whole('<tool_call>{"name": "get_time"}</tool_call>', TOOLS) == (
        "",
        [ParsedCall(name="get_time", arguments="{}")],
    )


def test_the_closing_tag_may_be_missing_or_early():
    missing = (
        '<tool_call>{"name": "get_time", "arguments": {}}\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Nice"}}'
    )
    assert [c.name for c in parse_whole(missing, TOOLS)[1]] == ["get_time", "get_weather"]
    early = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}</tool_call> done'
    assert parse_whole(early, TOOLS) == (
        "done",
        [ParsedCall(name="get_time", arguments='{"zone": "UTC"}')],
    )


def test_a_forced_call_is_the_json_object_itself_and_streams_too():
    text = ' {"name": "get_weather", "arguments": {"city": "Lima", "unit": "C", "n": [1, -2.5e3, true, null]}}'
    whole = parse_whole(text, TOOLS, forced=True)
    assert whole == (
        "",
        [
            ParsedCall(
                name="get_weather",
                arguments='{"city": "Lima", "unit": "C", "n": [1, -2.5e3, true, null]}',
            )
        ],
    )
    parser = ToolCallParser(TOOLS, forced=True)
    assert parser.feed(text[:30]) == [CallStart(0, "get_weather")]
    assert parser.feed(text[30:50]) == [ArgumentsDelta(0, text[38:50])]
    assert folded(fed(list(text), forced=True)) == whole


def test_a_forced_output_that_is_no_call_is_content():
    assert parse_whole('{"name": 12}', TOOLS, forced=True) == ('{"name": 12}', [])


def test_plain_text_is_content_trimmed_and_streams_as_it_comes():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("  It is ") == [ContentDelta("It is")]
    assert parser.feed("sunny.\n") == [ContentDelta(" sunny.")]
    assert parser.finish() == []

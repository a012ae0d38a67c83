"""Incremental parser of Hermes-style tool calls in a model's output, for streamed and whole
responses alike.

Text is fed as it arrives; the parser answers with events: content to show, a call starting
(its name known), and fragments of the call's JSON arguments. Markup is never content: a
`<tool_call>` tag, even split across chunks ("<tool", "_call>"), is held back until it is
known to be one. A block is a call once its "name" is one of the tools; its arguments then
stream as the model writes them, character for character, so their concatenation is the
model's JSON text of the arguments. A block that cannot be a call (not JSON, no such tool) is
given back as the content it was. Content is trimmed of the whitespace around it as a whole.

A whole response is parsed by feeding its text at once: the same events, so a streamed
response and a whole one always agree.

With a forced call (tool_choice "required" or a named function) the output is the call's JSON
object itself, with no tags: the parser starts inside the block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # small models write either
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_SPACE = frozenset(" \t\r\n")
_INSIDE_CONTAINERS = _SPACE | frozenset(",:")


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolCallEvent = ContentDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as the model wrote it


class _State(Enum):
    CONTENT = "content"
    CALL = "call"  # inside a block, reading its JSON object
    AFTER_CALL = "after call"  # the call is done: skipping to the closing tag
    NOT_A_CALL = "not a call"  # a block that is no call: kept whole, given back as content


class _Value:
    """One JSON value read a character at a time; knows where it ends, not whether it is
    valid JSON throughout (the model's text is passed on as written)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.closers: list[str] = []
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, char: str) -> bool:
        """Takes `char`; False if it is not part of the value (a scalar ended before it, or it
        cannot stand here), which the caller reads again."""
        if self.in_string:
            self.text.append(char)
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                self.done = not self.closers
            return True
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.closers.append("}" if char == "{" else "]")
        elif char in "}]":
            if not self.closers or self.closers[-1] != char:
                self.done = bool(self.text) and not self.closers
                return False
            self.closers.pop()
            self.done = not self.closers
        elif char not in _SCALAR_CHARS and not (self.closers and char in _INSIDE_CONTAINERS):
            self.done = bool(self.text) and not self.closers
            return False
        self.text.append(char)
        return True


class _Step(Enum):
    START = "start"  # before the {
    KEY = "key"  # before a key, or the }
    COLON = "colon"
    VALUE = "value"  # before a value
    NEXT = "next"  # after a value: , or }


@dataclass
class _Call:
    """Where the reading of one call block's JSON object stands."""

    step: _Step = _Step.START
    value: _Value | None = None  # the key or value being read
    reading_key: bool = False
    key: str = ""
    name: str | None = None
    arguments_key_seen: bool = False
    in_arguments: bool = False
    held_arguments: list[str] = field(default_factory=list)  # read before the name


class ToolCallParser:
    """Feed the model's text in pieces; each call returns the events those pieces make."""

    def __init__(self, tool_names: set[str], forced: bool = False) -> None:
        self._names = frozenset(tool_names)
        self._forced = forced
        self._state = _State.CALL if forced else _State.CONTENT
        self._call = _Call()
        self._calls = 0
        self._tag = ""  # what may be the start of a tag
        self._block: list[str] = []  # the raw text of the block being read
        self._space = ""  # whitespace held until content follows it
        self._started = False  # content has been given
        self._events: list[ToolCallEvent] = []

    @property
    def calls(self) -> int:
        """How many calls have started."""
        return self._calls

    def feed(self, text: str) -> list[ToolCallEvent]:
        for char in text:
            self._char(char)
        return self._take_events()

    def finish(self) -> list[ToolCallEvent]:
        """The events the end of the text makes: a tag never completed is content, a call
        never closed ends with the arguments that came."""
        if self._state is _State.CONTENT:
            self._content(self._tag)
            self._tag = ""
        elif self._state is _State.CALL and self._call.name is not None:
            self._end_call()
        elif self._state in (_State.CALL, _State.NOT_A_CALL):
            self._give_back_block()
        return self._take_events()

    def _take_events(self) -> list[ToolCallEvent]:
        events, self._events = _merged(self._events), []
        return events

    def _char(self, char: str) -> None:
        if self._state is _State.CONTENT:
            self._content_char(char)
        elif self._state is _State.AFTER_CALL:
            self._after_call_char(char)
        else:
            self._block.append(char)
            if self._state is _State.CALL:
                self._call_char(char)
            else:
                self._not_a_call_char()

    # -- content, and the tags around blocks

    def _content_char(self, char: str) -> None:
        candidate = self._tag + char
        if OPEN_TAG.startswith(candidate):
            self._tag = candidate
            if candidate == OPEN_TAG:
                self._open_block()
            return
        # a tag starts with its only "<": a broken one can only restart at this character
        self._tag = "<" if char == "<" else ""
        self._content(candidate[: len(candidate) - len(self._tag)])

    def _open_block(self) -> None:
        self._tag = ""
        self._block = [OPEN_TAG]
        self._call = _Call()
        self._state = _State.CALL

    def _after_call_char(self, char: str) -> None:
        if self._forced:
            return  # a forced call is all there is
        self._tag = (self._tag + char)[-len(CLOSE_TAG) :]
        if self._tag.endswith(CLOSE_TAG):
            self._tag = ""
            self._state = _State.CONTENT
        elif self._tag.endswith(OPEN_TAG):
            self._open_block()

    def _not_a_call_char(self) -> None:
        if not self._forced and "".join(self._block[-len(CLOSE_TAG) :]).endswith(CLOSE_TAG):
            self._give_back_block()

    def _content(self, text: str) -> None:
        """Content, trimmed: whitespace before the first and after the last character of
        content is dropped, so trailing whitespace is held until more content follows."""
        held = self._space + text
        body = held.rstrip()
        if not self._started:
            body = body.lstrip()
        if body:
            self._content_now(body)
            self._started = True
            self._space = held[len(held.rstrip()) :]
        else:
            self._space = held if self._started else ""

    def _content_now(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))

    def _give_back_block(self) -> None:
        """A block that is no call is content, as written."""
        block = "".join(self._block)
        self._block = []
        self._state = _State.CONTENT
        self._content(block)

    # -- calls

    def _start_call(self, name: str) -> None:
        self._call.name = name
        self._events.append(CallStart(self._calls, name))
        self._calls += 1
        if self._call.held_arguments:
            self._arguments("".join(self._call.held_arguments))

    def _arguments(self, text: str) -> None:
        self._events.append(ArgumentsDelta(self._calls - 1, text))

    def _end_call(self) -> None:
        if not self._call.arguments_key_seen:
            self._arguments("{}")
        self._block = []
        self._tag = ""
        self._state = _State.AFTER_CALL

    def _stop(self) -> None:
        """The block's JSON goes wrong: a call already started ends (its arguments are what
        came), a block not yet a call is none."""
        if self._call.name is not None:
            self._end_call()
        else:
            self._state = _State.NOT_A_CALL

    def _fail(self, char: str) -> None:
        """`char` cannot stand where it is. It is read again in the state that follows: it may
        start the closing tag."""
        self._stop()
        if self._state is _State.AFTER_CALL:
            self._after_call_char(char)
        else:
            self._not_a_call_char()

    def _call_char(self, char: str) -> None:
        call = self._call
        if call.value is not None:
            self._value_char(char)
            return
        if char in _SPACE:
            return
        if call.step is _Step.START and char == "{":
            call.step = _Step.KEY
        elif call.step is _Step.KEY and char == '"':
            call.value, call.reading_key = _Value(), True
            call.value.feed(char)
        elif call.step is _Step.COLON and char == ":":
            call.step, call.value = _Step.VALUE, _Value()
        elif call.step is _Step.NEXT and char == ",":
            call.step = _Step.KEY
        elif call.step in (_Step.KEY, _Step.NEXT) and char == "}":
            if call.name is None:
                self._fail(char)
            else:
                self._end_call()
        else:
            self._fail(char)

    def _value_char(self, char: str) -> None:
        call = self._call
        value = call.value
        assert value is not None
        if not value.text and char in _SPACE:
            return
        if value.feed(char):
            if call.in_arguments:
                if call.name is not None:
                    self._arguments(char)
                else:
                    call.held_arguments.append(char)
            if value.done:
                self._value_end("".join(value.text))
        elif value.done:  # a number or literal ended before this character
            self._value_end("".join(value.text))
            if self._state is _State.CALL:
                self._call_char(char)
            elif self._state is _State.AFTER_CALL:
                self._after_call_char(char)
        else:
            self._fail(char)

    def _value_end(self, text: str) -> None:
        call = self._call
        call.value = None
        if call.reading_key:
            call.reading_key = False
            try:
                call.key = json.loads(text)
            except ValueError:  # a bad escape
                self._stop()
                return
            call.step = _Step.COLON
            if call.key in _ARGUMENT_KEYS and not call.arguments_key_seen:
                call.arguments_key_seen = call.in_arguments = True
            return
        call.step = _Step.NEXT
        call.in_arguments = False
        if call.key == "name" and call.name is None:
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            if isinstance(name, str) and name in self._names:
                self._start_call(name)
            else:
                self._stop()


def _merged(events: list[ToolCallEvent]) -> list[ToolCallEvent]:
    """Neighbouring events of one kind (and call) as one."""
    merged: list[ToolCallEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + event.text)
        elif (
            isinstance(event, ArgumentsDelta)
            and isinstance(last, ArgumentsDelta)
            and last.index == event.index
        ):
            merged[-1] = ArgumentsDelta(last.index, last.text + event.text)
        else:
            merged.append(event)
    return merged


def parse_whole(
    text: str, tool_names: set[str], forced: bool = False
) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a whole output: what its stream of events adds up to."""
    parser = ToolCallParser(tool_names, forced)
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for event in [*parser.feed(text), *parser.finish()]:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, CallStart):
            names.append(event.name)
            arguments.append([])
        else:
            arguments[event.index].append(event.text)
    calls = [ParsedCall(name, "".join(args)) for name, args in zip(names, arguments, strict=True)]
    return "".join(content), calls

"""A batch's input file as a controller run holds it: the file's lines (text), the numbers of
the valid ones, and the parsed lines in flight. Parsing a line builds its OpenAI request and its
job request (kilobytes), so a run parses a line when it fans out and keeps it only until its job
is collected; memory follows the lines in flight, not the file."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

from producer_api.batches.lines import ParsedLine, iter_lines, parse_line


class InputLines:
    def __init__(self, raw_lines: list[str], endpoint: str, default_max_tokens: int) -> None:
        self.raw_lines = raw_lines  # the input file's lines, as str.splitlines gives them
        self.endpoint = endpoint
        self.default_max_tokens = default_max_tokens
        self.valid = array("q")  # numbers of the valid lines, in order
        self.parsed: dict[int, ParsedLine] = {}  # the lines in flight, by number

    def scan(self) -> Iterator[ParsedLine]:
        """Parse every line once (validation): note the valid lines' numbers, yield every
        line (the caller keeps what it needs of the invalid ones)."""
        for line in iter_lines(self.raw_lines, self.endpoint, self.default_max_tokens):
            if line.ok:
                self.valid.append(line.number)
            yield line

    def skip(self, invalid: Iterable[int]) -> None:
        """The valid lines from the invalid lines' numbers validation stored: no parsing."""
        refused = set(invalid)
        self.valid = array(
            "q",
            (
                number
                for number, raw in enumerate(self.raw_lines, start=1)
                if raw.strip() and number not in refused
            ),
        )

    def line(self, number: int) -> ParsedLine:
        """A line that was valid at validation, parsed (again, unless in flight)."""
        line = self.parsed.get(number)
        if line is None:
            raw = self.raw_lines[number - 1]
            line = parse_line(number, raw, self.endpoint, self.default_max_tokens)
        return line

    def valid_from(self, start: int) -> Iterator[ParsedLine]:
        """The valid lines from the `start`-th on, parsed one at a time."""
        for number in self.valid[start:]:
            yield self.line(number)

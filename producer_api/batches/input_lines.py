"""A batch's input file as a controller run holds it: the file's lines (text), the numbers of
the valid ones, and the parsed lines in flight. Parsing a line builds its OpenAI request and its
job request (kilobytes), so a run parses a line when it fans out and keeps it only until its job
is collected; memory follows the lines in flight, not the file. Validation keeps the first
valid lines it parsed, as many as may be in flight at once, so fan-out takes those without
parsing them again (a batch no larger than the in-flight cap parses each line once)."""

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
        # the lines in flight and those validation kept for fan-out, by number
        self.parsed: dict[int, ParsedLine] = {}

    def scan(self, keep: int) -> Iterator[ParsedLine]:
        """Parse every line once (validation): note the valid lines' numbers, keep the first
        `keep` valid lines parsed for fan-out, yield every line (the caller keeps what it needs
        of the invalid ones)."""
        for line in iter_lines(self.raw_lines, self.endpoint, self.default_max_tokens):
            if line.ok:
                self.valid.append(line.number)
                if len(self.parsed) < keep:
                    self.parsed[line.number] = line
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
        """A line that was valid at validation, parsed (again, unless in flight or kept)."""
        line = self.parsed.get(number)
        if line is None:
            raw = self.raw_lines[number - 1]
            line = parse_line(number, raw, self.endpoint, self.default_max_tokens)
        return line

    def valid_from(self, start: int) -> Iterator[ParsedLine]:
        """The valid lines from the `start`-th on, parsed one at a time."""
        for number in self.valid[start:]:
            yield self.line(number)

"""Syntax check of EBNF grammars, in the dialect the workers' grammar library (xgrammar) reads.

The API may not load the grammar library (it pulls in torch), yet a malformed grammar must be
refused before it is queued, with the place and the problem. So the dialect is checked here in
plain Python: rules `name ::= body`, one per line start; string literals with escapes;
character classes `[a-z]`, `[^...]` with escapes; groups; `|`; the quantifiers `*`, `+`, `?`,
`{m}`, `{m,}`, `{m,n}`; `#` comments; a lookahead `(= ...)` after a rule's body; rule
attributes `name[max_tokens=N, capture="x"]`; the library's macros (`Regex("...")`,
`TagDispatch(...)`, `Token(...)`, ...). The root rule must exist, each rule be defined once,
and every rule referenced be defined.

What is left to the library: the regex inside a `Regex(...)` macro, and whether the grammar can
be compiled against a vocabulary. A grammar that passes here and fails there fails its job with
the library's message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

ROOT_RULE = "root"
MAX_NESTING = 1000  # parenthesised groups inside one another, as the library allows
MAX_INTEGER = 10**15
_MAX_ATTRIBUTE_DIGITS = 10

_SPACE = " \t\n\r"
_STRING_ESCAPES = frozenset("0abefnrtv\"'/?\\")
_CLASS_ESCAPES = _STRING_ESCAPES | frozenset("$()*+-.[]^{|}")
_CLASS_SHORTHANDS = frozenset("dDsSwW")  # \d, \s, \w: not in this dialect's classes
_HEX = frozenset("0123456789abcdefABCDEF")
_MACROS = frozenset({"TagDispatch", "Token", "ExcludeToken", "TokenTagDispatch", "Regex"})


class GrammarSyntaxError(ValueError):
    """Where an EBNF grammar goes wrong, and how."""

    def __init__(self, line: int, column: int, problem: str) -> None:
        super().__init__(f"line {line}, column {column}: {problem}")
        self.line = line
        self.column = column
        self.problem = problem


class _Kind(Enum):
    NAME = "name"
    RULE_NAME = "rule name"
    BOOLEAN = "boolean"
    INTEGER = "integer"
    STRING = "string"
    CHAR_CLASS = "character class"
    ASSIGN = "::="
    LPAREN = "("
    LOOKAHEAD = "(="
    RPAREN = ")"
    LBRACE = "{"
    RBRACE = "}"
    PIPE = "|"
    COMMA = ","
    STAR = "*"
    PLUS = "+"
    QUESTION = "?"
    EQUAL = "="
    END = "end of input"


_PUNCTUATION = {
    ")": _Kind.RPAREN,
    "{": _Kind.LBRACE,
    "}": _Kind.RBRACE,
    "|": _Kind.PIPE,
    ",": _Kind.COMMA,
    "*": _Kind.STAR,
    "+": _Kind.PLUS,
    "?": _Kind.QUESTION,
    "=": _Kind.EQUAL,
}
_QUANTIFIERS = (_Kind.STAR, _Kind.PLUS, _Kind.QUESTION, _Kind.LBRACE)
_SEQUENCE_ENDS = (_Kind.PIPE, _Kind.RPAREN, _Kind.LOOKAHEAD, _Kind.RULE_NAME, _Kind.END)


@dataclass
class _Token:
    kind: _Kind
    text: str
    line: int
    column: int
    empty: bool = False  # a string literal "" or a group ()

    def shown(self) -> str:
        return "end of input" if self.kind is _Kind.END else repr(self.text)


def check_ebnf(grammar: str, root_rule: str = ROOT_RULE) -> None:
    """Raises GrammarSyntaxError at the first problem of `grammar`; returns if it is sound."""
    tokens = _Lexer(grammar).tokens()
    _mark_rule_names(tokens)
    _Parser(tokens, root_rule).check()


def _is_name_char(char: str, first: bool) -> bool:
    if char in "_-." or ("a" <= char <= "z") or ("A" <= char <= "Z"):
        return True
    return not first and "0" <= char <= "9"


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0
        self.line = 1
        self.column = 1

    def _peek(self, ahead: int = 0) -> str:
        index = self.at + ahead
        return self.text[index] if index < len(self.text) else ""

    def _advance(self, count: int = 1) -> None:
        for _ in range(count):
            char = self.text[self.at]
            # \n, \r and \r\n each end one line
            if char == "\n" or (char == "\r" and self._peek(1) != "\n"):
                self.line += 1
                self.column = 1
            else:
                self.column += 1
            self.at += 1

    def _error(self, problem: str) -> GrammarSyntaxError:
        return GrammarSyntaxError(self.line, self.column, problem)

    def _skip_space(self) -> None:
        while self._peek() and self._peek() in _SPACE + "#":
            if self._peek() == "#":
                while self._peek() and self._peek() not in "\r\n":
                    self._advance()
            else:
                self._advance()

    def tokens(self) -> list[_Token]:
        found: list[_Token] = []
        while True:
            self._skip_space()
            token = self._next()
            found.append(token)
            if token.kind is _Kind.END:
                return found

    def _next(self) -> _Token:
        line, column, start = self.line, self.column, self.at
        char = self._peek()

        def token(kind: _Kind, length: int) -> _Token:
            self._advance(length)
            return _Token(kind, self.text[start : self.at], line, column)

        if not char:
            return _Token(_Kind.END, "", line, column)
        if char == "(":
            return token(_Kind.LOOKAHEAD, 2) if self._peek(1) == "=" else token(_Kind.LPAREN, 1)
        if char in _PUNCTUATION:
            return token(_PUNCTUATION[char], 1)
        if char == ":":
            if self._peek(1) == ":" and self._peek(2) == "=":
                return token(_Kind.ASSIGN, 3)
            raise self._error("unexpected character ':' (a rule is written name ::= body)")
        if char == '"':
            return self._string(line, column)
        if char == "[":
            return self._char_class(line, column)
        if _is_name_char(char, first=True):
            return self._name(line, column)
        if char.isdigit() and char.isascii():
            return self._integer(line, column)
        raise self._error(f"unexpected character {char!r}")

    def _escape(self, allowed: frozenset[str]) -> int:
        """Length of the escape sequence at the cursor (which is on its backslash)."""
        kind = self._peek(1)
        if kind == "x":
            length = 2
            while self._peek(length) in _HEX and self._peek(length):
                length += 1
            if length > 2:
                return length
        elif kind in ("u", "U"):
            digits = 4 if kind == "u" else 8
            if all(self._peek(2 + i) in _HEX and self._peek(2 + i) for i in range(digits)):
                return 2 + digits
        elif kind and kind in allowed:
            return 2
        raise self._error(f"invalid escape sequence {self.text[self.at : self.at + 2]!r}")

    def _string(self, line: int, column: int) -> _Token:
        start = self.at
        self._advance()
        while self._peek() and self._peek() not in '"\r\n':
            self._advance(self._escape(_STRING_ESCAPES) if self._peek() == "\\" else 1)
        if self._peek() != '"':
            raise self._error('unterminated string literal (expected " before the line ends)')
        self._advance()
        text = self.text[start : self.at]
        return _Token(_Kind.STRING, text, line, column, empty=text == '""')

    def _class_char(self) -> tuple[str, int, int]:
        """The character class member at the cursor: (its text, line, column), consumed."""
        line, column, start = self.line, self.column, self.at
        if self._peek() == "\\":
            if self._peek(1) in _CLASS_SHORTHANDS and self._peek(1):
                raise self._error(
                    f"character class escape \\{self._peek(1)} is not supported in EBNF "
                    "classes; list the characters"
                )
            self._advance(self._escape(_CLASS_ESCAPES))
        else:
            self._advance()
        return self.text[start : self.at], line, column

    def _char_class(self, line: int, column: int) -> _Token:
        start = self.at
        self._advance()
        if self._peek() == "^":
            self._advance()
        members: list[tuple[str, int, int]] = []
        while self._peek() and self._peek() != "]":
            if self._peek() in "\r\n":
                raise self._error("a character class cannot span lines (expected ])")
            members.append(self._class_char())
        if not self._peek():
            raise self._error("unterminated character class (expected ])")
        self._advance()
        _check_ranges(members)
        return _Token(_Kind.CHAR_CLASS, self.text[start : self.at], line, column)

    def _name(self, line: int, column: int) -> _Token:
        start = self.at
        while self._peek() and _is_name_char(self._peek(), first=self.at == start):
            self._advance()
        name = self.text[start : self.at]
        if name in ("true", "false"):
            return _Token(_Kind.BOOLEAN, name, line, column)
        if self._peek() == "[":
            length = self._attributes_length(line, column)
            if length:
                self._advance(length)
        return _Token(_Kind.NAME, name, line, column)

    def _attributes_length(self, line: int, column: int) -> int:
        """Length of a rule attribute block `[max_tokens=N, capture="x"]` at the cursor, when
        one stands right before `::=`; 0 otherwise (the bracket then opens a class)."""
        text, at = self.text, self.at + 1

        def skip_blanks(i: int) -> int:
            while i < len(text) and text[i] in " \t":
                i += 1
            return i

        seen: set[str] = set()
        while True:
            at = skip_blanks(at)
            if text.startswith("max_tokens", at) and "max_tokens" not in seen:
                seen.add("max_tokens")
                at = skip_blanks(at + len("max_tokens"))
                if not text.startswith("=", at):
                    return 0
                at = skip_blanks(at + 1)
                digits = 0
                while at < len(text) and text[at].isdigit() and text[at].isascii():
                    at, digits = at + 1, digits + 1
                if digits == 0 or digits > _MAX_ATTRIBUTE_DIGITS:
                    return 0
            elif text.startswith("capture", at) and "capture" not in seen:
                seen.add("capture")
                at = skip_blanks(at + len("capture"))
                if text.startswith("=", at):
                    at = skip_blanks(at + 1)
                    end = text.find('"', at + 1) if text.startswith('"', at) else -1
                    if end < 0 or any(c in "\r\n\\" for c in text[at + 1 : end]):
                        return 0
                    if end == at + 1:
                        raise GrammarSyntaxError(line, column, "the capture name is empty")
                    at = end + 1
            else:
                return 0
            at = skip_blanks(at)
            if text.startswith(",", at):
                at += 1
                continue
            break
        if not text.startswith("]", at):
            return 0
        after = skip_blanks(at + 1)
        return at + 1 - self.at if text.startswith("::=", after) else 0

    def _integer(self, line: int, column: int) -> _Token:
        start = self.at
        while self._peek() and self._peek().isdigit() and self._peek().isascii():
            self._advance()
            if int(self.text[start : self.at]) > MAX_INTEGER:
                raise GrammarSyntaxError(line, column, f"integer larger than {MAX_INTEGER}")
        return _Token(_Kind.INTEGER, self.text[start : self.at], line, column)


_NAMED_ESCAPES = {"0": 0, "a": 7, "b": 8, "e": 27, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]+|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")


def _code_point(escape: str) -> int:
    """The character an escape sequence (backslash dropped) stands for."""
    if escape[0] in "xuU" and len(escape) > 1:
        return int(escape[1:], 16)
    return _NAMED_ESCAPES.get(escape, ord(escape))


def _class_code_point(member: str) -> int:
    return _code_point(member[1:]) if member.startswith("\\") else ord(member)


def _literal_value(literal: str) -> str:
    """The text a (lexically valid) string literal stands for, as code points."""
    return _ESCAPE.sub(lambda match: chr(min(_code_point(match.group(1)), 0x10FFFF)), literal[1:-1])


def _check_ranges(members: list[tuple[str, int, int]]) -> None:
    """A range `a-z` needs its lower bound first; a `-` that cannot make a range is a member."""
    index = 0
    while index < len(members):
        member, line, column = members[index]
        if index + 2 < len(members) and members[index + 1][0] == "-":
            upper = members[index + 2][0]
            if _class_code_point(member) > _class_code_point(upper):
                raise GrammarSyntaxError(
                    line, column, f"character range {member}-{upper} runs backwards"
                )
            index += 3
        else:
            index += 1


def _mark_rule_names(tokens: list[_Token]) -> None:
    """The name before each `::=` defines a rule, and must start its line."""
    for index, token in enumerate(tokens):
        if token.kind is not _Kind.ASSIGN:
            continue
        if index == 0:
            raise GrammarSyntaxError(token.line, token.column, "::= without a rule name before it")
        name = tokens[index - 1]
        if name.kind is not _Kind.NAME:
            raise GrammarSyntaxError(
                name.line, name.column, f"::= must follow a rule name, not {name.shown()}"
            )
        if index >= 2 and tokens[index - 2].line == name.line:
            raise GrammarSyntaxError(
                name.line, name.column, f"rule {name.text!r} must start at the beginning of a line"
            )
        name.kind = _Kind.RULE_NAME


def _closing_paren(tokens: list[_Token], opening: int) -> int:
    """Index of the ) that closes the ( at `opening` (the tokens are known to balance)."""
    depth = 0
    for index in range(opening, len(tokens)):
        if tokens[index].kind in (_Kind.LPAREN, _Kind.LOOKAHEAD):
            depth += 1
        elif tokens[index].kind is _Kind.RPAREN:
            depth -= 1
            if depth == 0:
                return index
    return len(tokens) - 1


def _check_lookahead(opening: _Token, body: list[_Token]) -> None:
    """A lookahead is one sequence, never alternatives and never the empty string, also when
    wrapped in groups: `(= ("a" | "b"))` is refused like `(= "a" | "b")`."""
    while True:
        depth = 0
        for token in body:
            depth += token.kind in (_Kind.LPAREN, _Kind.LOOKAHEAD)
            depth -= token.kind is _Kind.RPAREN
            if token.kind is _Kind.PIPE and depth == 0:
                raise GrammarSyntaxError(
                    opening.line, opening.column, "a lookahead cannot have alternatives (|)"
                )
        if (len(body) == 1 and body[0].empty) or [t.kind for t in body] == [
            _Kind.LPAREN,
            _Kind.RPAREN,
        ]:
            raise GrammarSyntaxError(
                opening.line, opening.column, "a lookahead cannot be the empty string"
            )
        wrapped = body and body[0].kind is _Kind.LPAREN
        if not wrapped or _closing_paren(body, 0) != len(body) - 1:
            return
        body = body[1:-1]


@dataclass
class _MacroValue:
    token: _Token
    items: list[_MacroValue] | None = None  # a tuple's elements


@dataclass
class _MacroArguments:
    positional: list[_MacroValue]
    named: dict[str, _MacroValue]


class _Parser:
    def __init__(self, tokens: list[_Token], root_rule: str) -> None:
        self.tokens = tokens
        self.at = 0
        self.root_rule = root_rule
        self.rules: set[str] = set()

    def _peek(self, ahead: int = 0) -> _Token:
        return self.tokens[min(self.at + ahead, len(self.tokens) - 1)]

    def _take(self) -> _Token:
        token = self._peek()
        self.at += 1
        return token

    @staticmethod
    def _error(token: _Token, problem: str) -> GrammarSyntaxError:
        return GrammarSyntaxError(token.line, token.column, problem)

    def _expect(self, kind: _Kind, problem: str) -> _Token:
        if self._peek().kind is not kind:
            raise self._error(self._peek(), f"{problem}, got {self._peek().shown()}")
        return self._take()

    def check(self) -> None:
        for token in self.tokens:
            if token.kind is _Kind.RULE_NAME:
                if token.text in self.rules:
                    raise self._error(token, f"rule {token.text!r} is defined more than once")
                self.rules.add(token.text)
        if self.root_rule not in self.rules:
            raise self._error(self.tokens[0], f"no root rule: define `{self.root_rule} ::= ...`")
        while self._peek().kind is not _Kind.END:
            self._rule()

    def _rule(self) -> None:
        self._expect(_Kind.RULE_NAME, "expected a rule (name ::= body)")
        self._take()  # ::=, which a rule name is always followed by
        self._choices()
        if self._peek().kind is _Kind.LOOKAHEAD:
            opening = self._take()
            start = self.at
            self._choices()
            body = self.tokens[start : self.at]
            self._expect(_Kind.RPAREN, "expected ) to close the lookahead")
            _check_lookahead(opening, body)

    def _choices(self) -> None:
        """Checks alternatives up to the end of a rule's body (or of its lookahead), groups
        included; without recursion, so deep nesting cannot exhaust the stack."""
        depth = 0
        expect_element, may_quantify = True, False
        while True:
            token = self._peek()
            if not expect_element:
                if may_quantify and token.kind in _QUANTIFIERS:
                    self._quantifier()
                    may_quantify = False
                    continue
                if token.kind is _Kind.RPAREN and depth > 0:
                    self._take()
                    depth -= 1
                    may_quantify = True
                    continue
                if token.kind is _Kind.PIPE:
                    self._take()
                    expect_element = True
                    continue
                if token.kind in _SEQUENCE_ENDS:
                    if depth > 0:
                        raise self._error(
                            token, f"expected ) to close a group, got {token.shown()}"
                        )
                    return
            if token.kind is _Kind.LPAREN and self._peek(1).kind is not _Kind.RPAREN:
                self._take()
                depth += 1
                if depth > MAX_NESTING:
                    raise self._error(token, f"groups nested deeper than {MAX_NESTING}")
                expect_element = True
                continue
            self._element()
            expect_element, may_quantify = False, True

    def _element(self) -> None:
        """Checks one element that is not an opening group."""
        token = self._take()
        if token.kind is _Kind.LPAREN:
            self._take()  # the ) of an empty group
            return
        if token.kind in (_Kind.STRING, _Kind.CHAR_CLASS):
            return
        if token.kind is _Kind.NAME:
            if token.text in _MACROS:
                self._macro(token)
            elif token.text not in self.rules:
                raise self._error(token, f"rule {token.text!r} is not defined")
            return
        raise self._error(
            token,
            "expected an element (a string, a character class, a rule name or a group), "
            f"got {token.shown()}",
        )

    def _quantifier(self) -> None:
        brace = self._take()
        if brace.kind is not _Kind.LBRACE:
            return
        lower = int(self._expect(_Kind.INTEGER, "expected a repeat count after {").text)
        if self._peek().kind is _Kind.RBRACE:
            self._take()
            return
        self._expect(_Kind.COMMA, "expected , or } in a repeat range")
        if self._peek().kind is _Kind.RBRACE:
            self._take()
            return
        if self._peek().kind is _Kind.NAME and self._peek().text == "-1":  # {m,-1}: unbounded
            self._take()
        else:
            upper_token = self._expect(_Kind.INTEGER, "expected the upper repeat count")
            if int(upper_token.text) < lower:
                raise self._error(
                    upper_token, f"repeat range {{{lower},{upper_token.text}}} runs backwards"
                )
        self._expect(_Kind.RBRACE, "expected } to close the repeat range")

    def _macro(self, name: _Token) -> None:
        self._expect(_Kind.LPAREN, f"expected ( after {name.text}")
        arguments = _MacroArguments([], {})
        if self._peek().kind is not _Kind.RPAREN:
            while True:
                if self._peek().kind is _Kind.NAME and self._peek(1).kind is _Kind.EQUAL:
                    key = self._take().text
                    self._take()
                    arguments.named[key] = self._macro_value(0)
                else:
                    arguments.positional.append(self._macro_value(0))
                if self._peek().kind is _Kind.COMMA:
                    self._take()
                elif self._peek().kind is not _Kind.RPAREN:
                    raise self._error(self._peek(), f"expected , or ) in {name.text}(...)")
                else:
                    break
        self._take()
        _MacroCheck(name, arguments, self.rules).check()

    def _macro_value(self, depth: int) -> _MacroValue:
        token = self._take()
        if token.kind in (_Kind.STRING, _Kind.INTEGER, _Kind.BOOLEAN, _Kind.NAME):
            return _MacroValue(token)
        if token.kind is not _Kind.LPAREN:
            raise self._error(
                token, f"expected a string, integer, boolean or tuple, got {token.shown()}"
            )
        if depth >= MAX_NESTING:
            raise self._error(token, f"tuples nested deeper than {MAX_NESTING}")
        items: list[_MacroValue] = []
        while self._peek().kind is not _Kind.RPAREN:
            items.append(self._macro_value(depth + 1))
            if self._peek().kind is _Kind.COMMA:
                self._take()
            elif self._peek().kind is not _Kind.RPAREN:
                raise self._error(
                    self._peek(), f"expected , or ) in a tuple, got {self._peek().shown()}"
                )
        self._take()
        return _MacroValue(token, items)


class _MacroCheck:
    """The arguments each of the library's macros takes."""

    def __init__(self, name: _Token, arguments: _MacroArguments, rules: set[str]) -> None:
        self.name = name
        self.arguments = arguments
        self.rules = rules

    def _error(self, problem: str) -> GrammarSyntaxError:
        return GrammarSyntaxError(self.name.line, self.name.column, f"{self.name.text}: {problem}")

    def check(self) -> None:
        macro = self.name.text
        if macro == "Regex":
            self._regex()
        elif macro in ("Token", "ExcludeToken"):
            self._token_ids()
        else:
            self._dispatch(by_token=macro == "TokenTagDispatch")

    def _regex(self) -> None:
        positional, named = self.arguments.positional, self.arguments.named
        if len(positional) != 1 or positional[0].token.kind is not _Kind.STRING:
            raise self._error("takes exactly one string (the pattern)")
        for key, value in named.items():
            if key != "json_string":
                raise self._error(f"unknown argument {key}")
            if value.token.kind is not _Kind.BOOLEAN:
                raise self._error("json_string must be true or false")

    def _token_ids(self) -> None:
        if self.arguments.named:
            raise self._error("takes no named arguments")
        if not self.arguments.positional:
            raise self._error("needs at least one token id")
        if any(value.token.kind is not _Kind.INTEGER for value in self.arguments.positional):
            raise self._error("token ids must be non-negative integers")

    def _dispatch(self, by_token: bool) -> None:
        trigger_kind = _Kind.INTEGER if by_token else _Kind.STRING
        triggers: list[str] = []
        for value in self.arguments.positional:
            pair = value.items
            if pair is None or len(pair) != 2:
                raise self._error("each argument must be a pair (trigger, rule)")
            trigger, rule = pair
            if trigger.token.kind is not trigger_kind or trigger.token.empty:
                raise self._error(
                    "a trigger must be a token id"
                    if by_token
                    else "a tag must be a non-empty string"
                )
            if rule.token.kind is not _Kind.NAME:
                raise self._error("the rule of a pair must be a rule name")
            if rule.token.text not in self.rules:
                raise self._error(f"rule {rule.token.text!r} is not defined")
            triggers.append(trigger.token.text)
        for key, value in self.arguments.named.items():
            if key == "loop_after_dispatch":
                if value.token.kind is not _Kind.BOOLEAN:
                    raise self._error("loop_after_dispatch must be true or false")
            elif key == "excludes":
                self._excludes(value, trigger_kind, triggers)
            else:
                raise self._error(f"unknown argument {key}")

    def _excludes(self, value: _MacroValue, kind: _Kind, triggers: list[str]) -> None:
        if value.items is None:
            raise self._error("excludes must be a tuple")
        for item in value.items:
            if item.token.kind is not kind or item.token.empty:
                raise self._error(
                    "excludes must be token ids"
                    if kind is _Kind.INTEGER
                    else "excludes must be non-empty strings"
                )
            excluded = item.token.text
            if kind is _Kind.INTEGER and int(excluded) in {int(t) for t in triggers}:
                raise self._error(f"token id {excluded} is both a trigger and excluded")
            if kind is _Kind.STRING and any(
                _literal_value(t).startswith(_literal_value(excluded)) for t in triggers
            ):
                raise self._error(f"exclude {excluded} is a prefix of a tag")

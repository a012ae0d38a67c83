"""Tokens of EBNF grammars in the grammar library's dialect (see `schemas.ebnf`): the lexer,
which also checks string escapes and character classes, and marks the rule names (the name
before each `::=`, which must start its line)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

MAX_INTEGER = 10**15
_MAX_ATTRIBUTE_DIGITS = 10

_SPACE = " \t\n\r"
_STRING_ESCAPES = frozenset("0abefnrtv\"'/?\\")
_CLASS_ESCAPES = _STRING_ESCAPES | frozenset("$()*+-.[]^{|}")
_CLASS_SHORTHANDS = frozenset("dDsSwW")  # \d, \s, \w: not in this dialect's classes
_HEX = frozenset("0123456789abcdefABCDEF")


class GrammarSyntaxError(ValueError):
    """Where an EBNF grammar goes wrong, and how."""

    def __init__(self, line: int, column: int, problem: str) -> None:
        super().__init__(f"line {line}, column {column}: {problem}")
        self.line = line
        self.column = column
        self.problem = problem


class TokenKind(Enum):
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
    ")": TokenKind.RPAREN,
    "{": TokenKind.LBRACE,
    "}": TokenKind.RBRACE,
    "|": TokenKind.PIPE,
    ",": TokenKind.COMMA,
    "*": TokenKind.STAR,
    "+": TokenKind.PLUS,
    "?": TokenKind.QUESTION,
    "=": TokenKind.EQUAL,
}


@dataclass
class Token:
    kind: TokenKind
    text: str
    line: int
    column: int
    empty: bool = False  # a string literal "" or a group ()

    def shown(self) -> str:
        return "end of input" if self.kind is TokenKind.END else repr(self.text)


def tokenize(grammar: str) -> list[Token]:
    """The grammar's tokens, rule names marked, ending with an END token; GrammarSyntaxError
    at the first problem."""
    tokens = _Lexer(grammar).tokens()
    _mark_rule_names(tokens)
    return tokens


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

    def tokens(self) -> list[Token]:
        found: list[Token] = []
        while True:
            self._skip_space()
            token = self._next()
            found.append(token)
            if token.kind is TokenKind.END:
                return found

    def _next(self) -> Token:
        line, column, start = self.line, self.column, self.at
        char = self._peek()

        def token(kind: TokenKind, length: int) -> Token:
            self._advance(length)
            return Token(kind, self.text[start : self.at], line, column)

        if not char:
            return Token(TokenKind.END, "", line, column)
        if char == "(":
            return (
                token(TokenKind.LOOKAHEAD, 2)
                if self._peek(1) == "="
                else token(TokenKind.LPAREN, 1)
            )
        if char in _PUNCTUATION:
            return token(_PUNCTUATION[char], 1)
        if char == ":":
            if self._peek(1) == ":" and self._peek(2) == "=":
                return token(TokenKind.ASSIGN, 3)
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

    def _string(self, line: int, column: int) -> Token:
        start = self.at
        self._advance()
        while self._peek() and self._peek() not in '"\r\n':
            self._advance(self._escape(_STRING_ESCAPES) if self._peek() == "\\" else 1)
        if self._peek() != '"':
            raise self._error('unterminated string literal (expected " before the line ends)')
        self._advance()
        text = self.text[start : self.at]
        return Token(TokenKind.STRING, text, line, column, empty=text == '""')

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

    def _char_class(self, line: int, column: int) -> Token:
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
        return Token(TokenKind.CHAR_CLASS, self.text[start : self.at], line, column)

    def _name(self, line: int, column: int) -> Token:
        start = self.at
        while self._peek() and _is_name_char(self._peek(), first=self.at == start):
            self._advance()
        name = self.text[start : self.at]
        if name in ("true", "false"):
            return Token(TokenKind.BOOLEAN, name, line, column)
        if self._peek() == "[":
            length = self._attributes_length(line, column)
            if length:
                self._advance(length)
        return Token(TokenKind.NAME, name, line, column)

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

    def _integer(self, line: int, column: int) -> Token:
        start = self.at
        while self._peek() and self._peek().isdigit() and self._peek().isascii():
            self._advance()
            if int(self.text[start : self.at]) > MAX_INTEGER:
                raise GrammarSyntaxError(line, column, f"integer larger than {MAX_INTEGER}")
        return Token(TokenKind.INTEGER, self.text[start : self.at], line, column)


_NAMED_ESCAPES = {"0": 0, "a": 7, "b": 8, "e": 27, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]+|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")


def _code_point(escape: str) -> int:
    """The character an escape sequence (backslash dropped) stands for."""
    if escape[0] in "xuU" and len(escape) > 1:
        return int(escape[1:], 16)
    return _NAMED_ESCAPES.get(escape, ord(escape))


def _class_code_point(member: str) -> int:
    return _code_point(member[1:]) if member.startswith("\\") else ord(member)


def literal_value(literal: str) -> str:
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


def _mark_rule_names(tokens: list[Token]) -> None:
    """The name before each `::=` defines a rule, and must start its line."""
    for index, token in enumerate(tokens):
        if token.kind is not TokenKind.ASSIGN:
            continue
        if index == 0:
            raise GrammarSyntaxError(token.line, token.column, "::= without a rule name before it")
        name = tokens[index - 1]
        if name.kind is not TokenKind.NAME:
            raise GrammarSyntaxError(
                name.line, name.column, f"::= must follow a rule name, not {name.shown()}"
            )
        if index >= 2 and tokens[index - 2].line == name.line:
            raise GrammarSyntaxError(
                name.line, name.column, f"rule {name.text!r} must start at the beginning of a line"
            )
        name.kind = TokenKind.RULE_NAME

"""The arguments each of the grammar library's EBNF macros takes (`Regex("...")`,
`TagDispatch(("tag", rule), ...)`, `Token(1, 2)`, ...): checked once the parser has read them."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.ebnf_lexer import GrammarSyntaxError, Token, TokenKind, literal_value

MACROS = frozenset({"TagDispatch", "Token", "ExcludeToken", "TokenTagDispatch", "Regex"})


@dataclass
class MacroValue:
    token: Token
    items: list[MacroValue] | None = None  # a tuple's elements


@dataclass
class MacroArguments:
    positional: list[MacroValue]
    named: dict[str, MacroValue]


def check_macro(name: Token, arguments: MacroArguments, rules: set[str]) -> None:
    """GrammarSyntaxError, at the macro's name, if its arguments do not fit it."""
    _MacroCheck(name, arguments, rules).check()


class _MacroCheck:
    """The arguments each of the library's macros takes."""

    def __init__(self, name: Token, arguments: MacroArguments, rules: set[str]) -> None:
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
        if len(positional) != 1 or positional[0].token.kind is not TokenKind.STRING:
            raise self._error("takes exactly one string (the pattern)")
        for key, value in named.items():
            if key != "json_string":
                raise self._error(f"unknown argument {key}")
            if value.token.kind is not TokenKind.BOOLEAN:
                raise self._error("json_string must be true or false")

    def _token_ids(self) -> None:
        if self.arguments.named:
            raise self._error("takes no named arguments")
        if not self.arguments.positional:
            raise self._error("needs at least one token id")
        if any(value.token.kind is not TokenKind.INTEGER for value in self.arguments.positional):
            raise self._error("token ids must be non-negative integers")

    def _dispatch(self, by_token: bool) -> None:
        trigger_kind = TokenKind.INTEGER if by_token else TokenKind.STRING
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
            if rule.token.kind is not TokenKind.NAME:
                raise self._error("the rule of a pair must be a rule name")
            if rule.token.text not in self.rules:
                raise self._error(f"rule {rule.token.text!r} is not defined")
            triggers.append(trigger.token.text)
        for key, value in self.arguments.named.items():
            if key == "loop_after_dispatch":
                if value.token.kind is not TokenKind.BOOLEAN:
                    raise self._error("loop_after_dispatch must be true or false")
            elif key == "excludes":
                self._excludes(value, trigger_kind, triggers)
            else:
                raise self._error(f"unknown argument {key}")

    def _excludes(self, value: MacroValue, kind: TokenKind, triggers: list[str]) -> None:
        if value.items is None:
            raise self._error("excludes must be a tuple")
        for item in value.items:
            if item.token.kind is not kind or item.token.empty:
                raise self._error(
                    "excludes must be token ids"
                    if kind is TokenKind.INTEGER
                    else "excludes must be non-empty strings"
                )
            excluded = item.token.text
            if kind is TokenKind.INTEGER and int(excluded) in {int(t) for t in triggers}:
                raise self._error(f"token id {excluded} is both a trigger and excluded")
            if kind is TokenKind.STRING and any(
                literal_value(t).startswith(literal_value(excluded)) for t in triggers
            ):
                raise self._error(f"exclude {excluded} is a prefix of a tag")

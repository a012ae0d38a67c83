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

from schemas.ebnf_lexer import GrammarSyntaxError, Token, TokenKind, tokenize
from schemas.ebnf_macros import MACROS, MacroArguments, MacroValue, check_macro

__all__ = ["ROOT_RULE", "GrammarSyntaxError", "check_ebnf"]

ROOT_RULE = "root"
MAX_NESTING = 1000  # parenthesised groups inside one another, as the library allows

_QUANTIFIERS = (TokenKind.STAR, TokenKind.PLUS, TokenKind.QUESTION, TokenKind.LBRACE)
_SEQUENCE_ENDS = (
    TokenKind.PIPE,
    TokenKind.RPAREN,
    TokenKind.LOOKAHEAD,
    TokenKind.RULE_NAME,
    TokenKind.END,
)


def check_ebnf(grammar: str, root_rule: str = ROOT_RULE) -> None:
    """Raises GrammarSyntaxError at the first problem of `grammar`; returns if it is sound."""
    _Parser(tokenize(grammar), root_rule).check()


def _closing_paren(tokens: list[Token], opening: int) -> int:
    """Index of the ) that closes the ( at `opening` (the tokens are known to balance)."""
    depth = 0
    for index in range(opening, len(tokens)):
        if tokens[index].kind in (TokenKind.LPAREN, TokenKind.LOOKAHEAD):
            depth += 1
        elif tokens[index].kind is TokenKind.RPAREN:
            depth -= 1
            if depth == 0:
                return index
    return len(tokens) - 1


def _check_lookahead(opening: Token, body: list[Token]) -> None:
    """A lookahead is one sequence, never alternatives and never the empty string, also when
    wrapped in groups: `(= ("a" | "b"))` is refused like `(= "a" | "b")`."""
    while True:
        depth = 0
        for token in body:
            depth += token.kind in (TokenKind.LPAREN, TokenKind.LOOKAHEAD)
            depth -= token.kind is TokenKind.RPAREN
            if token.kind is TokenKind.PIPE and depth == 0:
                raise GrammarSyntaxError(
                    opening.line, opening.column, "a lookahead cannot have alternatives (|)"
                )
        if (len(body) == 1 and body[0].empty) or [t.kind for t in body] == [
            TokenKind.LPAREN,
            TokenKind.RPAREN,
        ]:
            raise GrammarSyntaxError(
                opening.line, opening.column, "a lookahead cannot be the empty string"
            )
        wrapped = body and body[0].kind is TokenKind.LPAREN
        if not wrapped or _closing_paren(body, 0) != len(body) - 1:
            return
        body = body[1:-1]


class _Parser:
    def __init__(self, tokens: list[Token], root_rule: str) -> None:
        self.tokens = tokens
        self.at = 0
        self.root_rule = root_rule
        self.rules: set[str] = set()

    def _peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.at + ahead, len(self.tokens) - 1)]

    def _take(self) -> Token:
        token = self._peek()
        self.at += 1
        return token

    @staticmethod
    def _error(token: Token, problem: str) -> GrammarSyntaxError:
        return GrammarSyntaxError(token.line, token.column, problem)

    def _expect(self, kind: TokenKind, problem: str) -> Token:
        if self._peek().kind is not kind:
            raise self._error(self._peek(), f"{problem}, got {self._peek().shown()}")
        return self._take()

    def check(self) -> None:
        for token in self.tokens:
            if token.kind is TokenKind.RULE_NAME:
                if token.text in self.rules:
                    raise self._error(token, f"rule {token.text!r} is defined more than once")
                self.rules.add(token.text)
        if self.root_rule not in self.rules:
            raise self._error(self.tokens[0], f"no root rule: define `{self.root_rule} ::= ...`")
        while self._peek().kind is not TokenKind.END:
            self._rule()

    def _rule(self) -> None:
        self._expect(TokenKind.RULE_NAME, "expected a rule (name ::= body)")
        self._take()  # ::=, which a rule name is always followed by
        self._choices()
        if self._peek().kind is TokenKind.LOOKAHEAD:
            opening = self._take()
            start = self.at
            self._choices()
            body = self.tokens[start : self.at]
            self._expect(TokenKind.RPAREN, "expected ) to close the lookahead")
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
                if token.kind is TokenKind.RPAREN and depth > 0:
                    self._take()
                    depth -= 1
                    may_quantify = True
                    continue
                if token.kind is TokenKind.PIPE:
                    self._take()
                    expect_element = True
                    continue
                if token.kind in _SEQUENCE_ENDS:
                    if depth > 0:
                        raise self._error(
                            token, f"expected ) to close a group, got {token.shown()}"
                        )
                    return
            if token.kind is TokenKind.LPAREN and self._peek(1).kind is not TokenKind.RPAREN:
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
        if token.kind is TokenKind.LPAREN:
            self._take()  # the ) of an empty group
            return
        if token.kind in (TokenKind.STRING, TokenKind.CHAR_CLASS):
            return
        if token.kind is TokenKind.NAME:
            if token.text in MACROS:
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
        if brace.kind is not TokenKind.LBRACE:
            return
        lower = int(self._expect(TokenKind.INTEGER, "expected a repeat count after {").text)
        if self._peek().kind is TokenKind.RBRACE:
            self._take()
            return
        self._expect(TokenKind.COMMA, "expected , or } in a repeat range")
        if self._peek().kind is TokenKind.RBRACE:
            self._take()
            return
        if self._peek().kind is TokenKind.NAME and self._peek().text == "-1":  # {m,-1}: unbounded
            self._take()
        else:
            upper_token = self._expect(TokenKind.INTEGER, "expected the upper repeat count")
            if int(upper_token.text) < lower:
                raise self._error(
                    upper_token, f"repeat range {{{lower},{upper_token.text}}} runs backwards"
                )
        self._expect(TokenKind.RBRACE, "expected } to close the repeat range")

    def _macro(self, name: Token) -> None:
        self._expect(TokenKind.LPAREN, f"expected ( after {name.text}")
        arguments = MacroArguments([], {})
        if self._peek().kind is not TokenKind.RPAREN:
            while True:
                if self._peek().kind is TokenKind.NAME and self._peek(1).kind is TokenKind.EQUAL:
                    key = self._take().text
                    self._take()
                    arguments.named[key] = self._macro_value(0)
                else:
                    arguments.positional.append(self._macro_value(0))
                if self._peek().kind is TokenKind.COMMA:
                    self._take()
                elif self._peek().kind is not TokenKind.RPAREN:
                    raise self._error(self._peek(), f"expected , or ) in {name.text}(...)")
                else:
                    break
        self._take()
        check_macro(name, arguments, self.rules)

    def _macro_value(self, depth: int) -> MacroValue:
        token = self._take()
        if token.kind in (TokenKind.STRING, TokenKind.INTEGER, TokenKind.BOOLEAN, TokenKind.NAME):
            return MacroValue(token)
        if token.kind is not TokenKind.LPAREN:
            raise self._error(
                token, f"expected a string, integer, boolean or tuple, got {token.shown()}"
            )
        if depth >= MAX_NESTING:
            raise self._error(token, f"tuples nested deeper than {MAX_NESTING}")
        items: list[MacroValue] = []
        while self._peek().kind is not TokenKind.RPAREN:
            items.append(self._macro_value(depth + 1))
            if self._peek().kind is TokenKind.COMMA:
                self._take()
            elif self._peek().kind is not TokenKind.RPAREN:
                raise self._error(
                    self._peek(), f"expected , or ) in a tuple, got {self._peek().shown()}"
                )
        self._take()
        return MacroValue(token, items)

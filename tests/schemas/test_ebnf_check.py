"""The API's EBNF syntax check agrees with the grammar library the workers compile with: every
grammar the library reads passes, every grammar it refuses is refused here too, with the line
and column of the problem."""

from __future__ import annotations

import random

import pytest

from schemas.ebnf import GrammarSyntaxError, check_ebnf

xgrammar = pytest.importorskip("xgrammar")

VALID = [
    'root ::= "a"',
    'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]',
    'root ::= "positive" | "negative" | "neutral"',
    r'root ::= [a-z]+ "\n" [^"\\] "\x41\u00e9\U0001F600\t\r\"\\"',
    r'root ::= "\0\a\b\e\f\v\'\/\?" "\x4" "\u00411"',
    r'root ::= [\n\t\r\x41\u00e9] [\/\.\*\+\?\(\)\{\}\|\$\^\[\]\-\\"]',
    'root ::= [] [^] [-a] [a-] [^-] [--z] [^^] [a^] ["] [#] [é-ü]',
    'root ::= "a"{2,3} "b"{2,} "c"{2} "d"{ 2 , 3 } "e"{0} "f"{1,-1}',
    'root ::= ("a" | "b")* (=("c"))',
    'root ::= () "" ()* ""+ "a"?',
    'root ::= a\na ::= "x" # a comment\n# a comment line\n',
    'root ::= a-b.c\na-b.c ::= "x"',
    'root ::= "a"\r\nb ::= "x"\r\n',
    '\n\n  root ::= "a"',
    'root ::=\n  "a"\n  | "b"\n  +',
    'root\n::= "a"',
    'x ::= "a"\nroot ::= x (= "b" "c")',
    'root ::= "a"\n(= "b")',
    'root ::= root "a" | "b"',
    'root ::= "a" (= "b" "")',
    'root ::= "a" (= ("b" ""))',
    'root ::= "a" (= "b"*)',
    'root ::= "a" (= ("b" | "c") "d")',
    'root[max_tokens=3] ::= "a"',
    'root[max_tokens=3, capture] ::= "a"',
    'root[capture="q",max_tokens=7] ::= x[a]\nx ::= "b"',
    'root ::= Regex("[a-z]+") Regex("a", json_string=true)',
    'root ::= TagDispatch(("<a>", x), loop_after_dispatch=false, excludes=("q",))\nx ::= "b"',
    "root ::= TagDispatch()",
    "root ::= Token(1, 2) ExcludeToken(3)",
    'root ::= TokenTagDispatch((1, x), excludes=(2,))\nx ::= "a"',
    "root ::= " + "(" * 1000 + '"a"' + ")" * 1000,
]

INVALID = [
    ('root ::= "a" |', 1, 15),
    ("root ::= 'a'", 1, 10),
    (r'root ::= "\q"', 1, 11),
    (r'root ::= "\x"', 1, 11),
    (r'root ::= "\u12"', 1, 11),
    (r'root ::= "\U0001F60"', 1, 11),
    ('root ::= "unterminated', 1, 23),
    ('root ::= "a\nb"', 1, 12),
    (r"root ::= [\d]", 1, 11),
    (r"root ::= [\q]", 1, 11),
    ("root ::= [z-a]", 1, 11),
    (r"root ::= [a-\-]", 1, 11),
    ("root ::= [a\nb]", 1, 12),
    ("root ::= [abc", 1, 14),
    ('root ::= "a"{3,2}', 1, 16),
    ('root ::= "a"{,2}', 1, 14),
    ('root ::= "a"{-1}', 1, 14),
    ('root ::= "a"{+2}', 1, 14),
    ('root ::= "a"{2', 1, 15),
    ("root ::= x", 1, 10),
    ('Root ::= "a"', 1, 1),
    ("", 1, 1),
    ('root ::= "a" root ::= "b"', 1, 14),
    ('root ::= "a"\nroot ::= "b"', 2, 1),
    ('root ::= "a" .', 1, 14),
    ('root ::= "a"**', 1, 14),
    ('root ::= "a"?*', 1, 14),
    ('root ::= "a" = "b"', 1, 14),
    ('root ::= "a" , "b"', 1, 14),
    ('root ::= "a" 12', 1, 14),
    ("root ::= 1", 1, 10),
    ("root ::= true", 1, 10),
    ('root ::= "a" | | "b"', 1, 16),
    ('root ::= ("a" |)', 1, 16),
    ("root ::= (", 1, 11),
    ('root ::= "a")', 1, 13),
    ('root ::= ("a"', 1, 14),
    ('root ::= ::= "a"', 1, 6),
    ('::= "a"', 1, 1),
    ('true ::= "a"', 1, 1),
    ('root ::= "a" ; "b"', 1, 14),
    ('root ::= "a" é', 1, 14),
    ('root ::= "a" : "b"', 1, 14),
    ('root ::= "a" (= "b") "c"', 1, 22),
    ('root ::= ("a" (= "b"))', 1, 15),
    ('root ::= (= "a")', 1, 10),
    ('root ::= "a" (= )', 1, 17),
    ('root ::= "a" (= "b" | "c")', 1, 14),
    ('root ::= "a" (= ("b" | "c"))', 1, 14),
    ('root ::= "a" (= ())', 1, 14),
    ('root ::= "a" (= "")', 1, 14),
    ('root ::= "a" (= (""))', 1, 14),
    ('root[capture=""] ::= "a"', 1, 1),
    ('root[capture, capture] ::= "a"', 1, 5),
    ('root[max_tokens] ::= "a"', 1, 5),
    ('root ::= x\nx ::= "a" y ::= "b"', 2, 11),
    ('root ::= Foo("a")', 1, 10),
    ("root ::= Regex", 1, 15),
    ('root ::= Regex("a"', 1, 19),
    ("root ::= Regex(1)", 1, 10),
    ('root ::= Regex("a", "b")', 1, 10),
    ('root ::= Regex(x="a")', 1, 10),
    ('root ::= TagDispatch(("<a>", y))\nx ::= "a"', 1, 10),
    ('root ::= TagDispatch(("", x))\nx ::= "b"', 1, 10),
    ('root ::= TagDispatch(("a", x),)\nx ::= "b"', 1, 31),
    ("root ::= TagDispatch(foo=1)", 1, 10),
    ('root ::= TagDispatch(("a", x), excludes=1)\nx ::= "b"', 1, 10),
    ('root ::= TagDispatch(("<a>", x), excludes=("<",))\nx ::= "b"', 1, 10),
    ("root ::= Token()", 1, 10),
    ("root ::= Token(-1)", 1, 10),
    ('root ::= Token(1, "a")', 1, 10),
    ('root ::= TokenTagDispatch((1, x), excludes=(1,))\nx ::= "a"', 1, 10),
    ('root ::= "a"{10000000000000000}', 1, 14),
    ("root ::= " + "(" * 1001 + '"a"' + ")" * 1001, 1, 1010),
]


def library_accepts(grammar: str) -> bool:
    try:
        xgrammar.Grammar.from_ebnf(grammar)
    except (RuntimeError, UnicodeDecodeError):  # the latter: a message cut inside a character
        return False
    return True


@pytest.mark.parametrize("grammar", VALID)
def test_grammars_the_library_reads_pass(grammar: str) -> None:
    assert library_accepts(grammar), "the case list is wrong: the library refuses it"
    check_ebnf(grammar)


@pytest.mark.parametrize(("grammar", "line", "column"), INVALID)
def test_grammars_the_library_refuses_are_refused_where_they_go_wrong(
    grammar: str, line: int, column: int
) -> None:
    assert not library_accepts(grammar), "the case list is wrong: the library reads it"
    with pytest.raises(GrammarSyntaxError) as caught:
        check_ebnf(grammar)
    assert (caught.value.line, caught.value.column) == (line, column), str(caught.value)
    assert str(caught.value).startswith(f"line {line}, column {column}: ")


def test_the_message_says_what_is_wrong() -> None:
    problems = {
        'root ::= "a" |': "expected an element",
        "root ::= x": "rule 'x' is not defined",
        'start ::= "a"': "no root rule",
        'root ::= "a"\nroot ::= "b"': "defined more than once",
        "root ::= [z-a]": "runs backwards",
        'root ::= "a" root ::= "b"': "beginning of a line",
    }
    for grammar, words in problems.items():
        with pytest.raises(GrammarSyntaxError, match=words):
            check_ebnf(grammar)


EDITS = [*'"()[]{}|*+?=,:#\\-^ \n\tabxu019', "::=", "(=", "root", "Regex(", '""']


def test_random_edits_of_the_cases_are_judged_as_the_library_judges_them() -> None:
    rng = random.Random(7)
    bases = [g for g in VALID if len(g) < 200] + [g for g, _, _ in INVALID if len(g) < 200]
    for _ in range(2000):
        grammar = rng.choice(bases)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(grammar) + 1)
            if rng.random() < 0.4:
                grammar = grammar[:at] + grammar[at + 1 :]
            else:
                grammar = grammar[:at] + rng.choice(EDITS) + grammar[at:]
        try:
            check_ebnf(grammar)
            passed = True
        except GrammarSyntaxError:
            passed = False
        assert passed == library_accepts(grammar), repr(grammar)

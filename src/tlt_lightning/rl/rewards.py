"""Lenient answer extraction from free-form completions of small models.

SmolLM2-135M-Instruct almost never writes ``<answer>`` tags (see ``docs/tasks.md``): it writes
sentences such as ``"2 + -1 = 3."`` or ``"The final answer to this problem is 15."``. A strict
extractor would score nearly every completion 0, leaving GRPO with no reward variance to learn
from, so extraction falls back through progressively weaker cues, strongest first:

1. ``<answer>...</answer>`` (the last pair), the format most RL recipes ask for;
2. ``\\boxed{...}`` (the last one);
3. a phrase: ``"the answer is X"``, ``"final answer: X"``, ``"the result is X"`` (the last one);
4. ``number`` answers: the last ``"= X"``; ``expression`` answers: the last arithmetic expression;
5. ``number`` answers: the last number anywhere.

Cues 1-3 are *explicit*: the model said which part is its answer. :func:`follows_format` is true
exactly then, and the task reward adds a small bonus for it (``TaskConfig.format_weight``).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from tlt_lightning.validation import check

__all__ = [
    "ANSWER_KINDS",
    "EXPLICIT_SOURCES",
    "AnswerKind",
    "Extraction",
    "extract_answer",
    "find_answer",
    "follows_format",
]

AnswerKind = Literal["number", "expression"]
ANSWER_KINDS: tuple[str, ...] = ("number", "expression")
EXPLICIT_SOURCES: frozenset[str] = frozenset({"tag", "boxed", "phrase"})

# A number as models write it: optional sign, thousands separators ("1,000" but not "1, 2"),
# optional decimals. The unicode minus is normalised to "-" before matching.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])({_NUMBER})(?![\d])")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
# One level of nested braces is enough for \boxed{\frac{1}{2}}-style answers.
_BOXED_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
# "the (final) answer/result ... is/:/= X": up to 60 characters of filler between the noun and the
# verb ("The final answer to this problem is 15"), then a little decoration before X ("is: **7**").
_PHRASE_RE = re.compile(
    r"\b(?:answer|result)\b[^\n]{0,60}?(?:\bis\b|\bequals\b|\bwould be\b|\bwill be\b|:|=)"
    r"[ \t]*(?:equal to|approximately)?[ \t:*$`(\[]*([^\n]*)",
    re.IGNORECASE,
)
_EQUALS_RE = re.compile(rf"=[ \t*$`]*({_NUMBER})(?![\d])")
# A run of arithmetic on one line: digits, operators, parentheses and spaces, starting and ending
# on an operand. Expressions are the answers of countdown ("(50 + 2) * 3").
_EXPRESSION_RE = re.compile(r"[\d(][\d \t+\-*/().]*[\d)]")
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)|[;!?\n]")
_OPERATOR_RE = re.compile(r"\d\s*[)]*\s*[+\-*/]\s*[(]*\s*\d")


class Extraction(NamedTuple):
    """An answer found in a completion.

    Attributes:
        answer: the extracted answer text, stripped: an expression, or a number in canonical form
            (no thousands separators, no ``+`` sign, no all-zero decimals: ``"+1,250.00"`` is
            ``"1250"``), since some reasoning-gym scorers compare strings.
        source: which cue found it: ``"tag"``, ``"boxed"``, ``"phrase"``, ``"equals"``,
            ``"expression"`` or ``"last_number"``. The first three are explicit
            (:data:`EXPLICIT_SOURCES`).
    """

    answer: str
    source: str


def _normalise(text: str) -> str:
    # Unicode minus/multiply/divide are common in chat output; the scorers only read ASCII.
    return text.replace("\u2212", "-").replace("\u00d7", "*").replace("\u00f7", "/")


def _clean_number(number: str) -> str:
    # Canonical form for the scorers, some of which compare strings: "+1,250.00" -> "1250".
    number = number.replace(",", "").lstrip("+")
    if re.fullmatch(r"-?\d+\.0+", number):
        number = number.split(".")[0]
    return number


def _number_in(text: str, last: bool = True) -> str | None:
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return _clean_number(matches[-1] if last else matches[0])


def _expression_in(text: str) -> str | None:
    """The last span of ``text`` that is an arithmetic expression with at least one operator."""
    spans = [m.group(0).strip() for m in _EXPRESSION_RE.finditer(text)]
    spans = [s for s in spans if _OPERATOR_RE.search(s) and s.count("(") == s.count(")")]
    return spans[-1] if spans else None


def _answer_in(fragment: str, kind: AnswerKind, after_phrase: bool) -> str | None:
    """Pull the answer of ``kind`` out of a fragment that a cue pointed at."""
    fragment = fragment.strip()
    if after_phrase:
        # "is 7. Then 3 + 4 = 7": only the sentence right after the phrase is the answer.
        fragment = _SENTENCE_END_RE.split(fragment, maxsplit=1)[0]
    if kind == "expression":
        # "(50 + 2) * 3 = 156": the expression is the left-hand side.
        return _expression_in(fragment.split("=")[0]) or _number_in(fragment, last=False)
    if re.fullmatch(_NUMBER, fragment):
        return _clean_number(fragment)
    # "x = 7", "5 - 3 = 2": the value is after the last "=".
    if "=" in fragment:
        fragment = fragment.rsplit("=", 1)[1]
    return _number_in(fragment, last=not after_phrase)


def find_answer(completion: str, kind: AnswerKind = "number") -> Extraction | None:
    """Find the answer in a completion and say which cue found it.

    Args:
        completion: the generated text (special tokens already stripped).
        kind: ``"number"`` for numeric answers (basic_arithmetic, chain_sum, gsm_symbolic),
            ``"expression"`` for arithmetic expressions (countdown).

    Returns:
        The answer and its source, or ``None`` when nothing answer-like is in the completion.

    Example:
        >>> find_answer("2 + -1 = 3.")
        Extraction(answer='3', source='equals')
    """
    check(kind in ANSWER_KINDS, "kind", kind, f"one of {ANSWER_KINDS}")
    text = _normalise(completion)
    tags = _TAG_RE.findall(text)
    if tags:
        # Expressions are cut down to digits, operators and parentheses in every branch: countdown
        # scores them with sympy's parse_expr, which evaluates Python, so no free text may reach it.
        answer = _answer_in(tags[-1], kind, after_phrase=False)
        if answer:
            return Extraction(answer, "tag")
    boxed = _BOXED_RE.findall(text)
    if boxed:
        answer = _answer_in(boxed[-1], kind, after_phrase=False)
        if answer:
            return Extraction(answer, "boxed")
    for fragment in reversed(_PHRASE_RE.findall(text)):
        answer = _answer_in(fragment, kind, after_phrase=True)
        if answer:
            return Extraction(answer, "phrase")
    if kind == "expression":
        answer = _expression_in(text)
        return Extraction(answer, "expression") if answer else None
    equals = _EQUALS_RE.findall(text)
    if equals:
        return Extraction(_clean_number(equals[-1]), "equals")
    answer = _number_in(text)
    return Extraction(answer, "last_number") if answer else None


def extract_answer(completion: str, kind: AnswerKind = "number") -> str | None:
    """The answer in a completion, leniently (see the module docstring for the cue order).

    Args:
        completion: the generated text.
        kind: ``"number"`` or ``"expression"``.

    Returns:
        The answer text, or ``None`` when the completion holds nothing answer-like.

    Example:
        >>> extract_answer("Adding them up, the answer is 42.")
        '42'
        >>> extract_answer("<answer>(5 + 3) * 2</answer>", kind="expression")
        '(5 + 3) * 2'
        >>> extract_answer("I don't know.") is None
        True
    """
    found = find_answer(completion, kind)
    return found.answer if found else None


def follows_format(completion: str, kind: AnswerKind = "number") -> bool:
    """Whether the completion marks its answer explicitly (tags, ``\\boxed{}`` or a phrase).

    Example:
        >>> follows_format("The answer is 7."), follows_format("3 + 4 = 7")
        (True, False)
    """
    found = find_answer(completion, kind)
    return found is not None and found.source in EXPLICIT_SOURCES

"""The calculator tool: a safe arithmetic evaluator over a small, bounded grammar.

An expression is parsed with ``ast.parse(expr, mode="eval")`` and walked by hand; nothing
is ever passed to ``eval`` or ``exec``. Allowed: int and float literals, ``+ - * /``,
parentheses and unary ``-``/``+``. Everything else (names, calls, attributes, ``**``,
``//``, ``%``, comparisons, strings, booleans) is refused with a short reason.

Arithmetic is exact (``fractions.Fraction``): ``(1 / 3) * 3`` is 1 and ``0.1 + 0.2`` is
0.3, so whether a result is whole never depends on float rounding. Sizes are bounded
before any work (characters, then AST nodes, which also bound the walk's recursion depth)
and every intermediate value is bounded in magnitude, so no expression a policy writes can
take long or grow large.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_CHARS = 200  # an expression's characters, surrounding whitespace excluded
MAX_NODES = 64  # AST nodes (``1 + 2`` is five: the expression, the sum, +, two literals)
MAX_ABS = 10**12  # largest magnitude of a literal or of any intermediate value

_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div)
# what a refused construct is called in the error, by its operator's or its node's type
_REFUSED = {ast.Pow: "'**' is", ast.FloorDiv: "'//' is", ast.Mod: "'%' is",
            ast.MatMult: "'@' is", ast.Not: "'not' is", ast.Invert: "'~' is",
            ast.Name: "names are", ast.Call: "function calls are",
            ast.Attribute: "attributes are", ast.Subscript: "subscripts are",
            ast.Compare: "comparisons are", ast.BoolOp: "'and' and 'or' are"}


class CalcError(ValueError):
    """An expression the calculator refuses; ``reason`` is short enough for an
    observation (``division by zero``, ``names are not allowed``)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def evaluate(expr: str) -> int | float:
    """The value of ``expr``: an int when it is whole, else the nearest float.

    Raises:
        CalcError: empty, too long, not arithmetic (a name, a call, ``**``...), division by
            zero, or a literal or intermediate value beyond ``MAX_ABS``.
    """
    value = evaluate_exact(expr)
    return int(value) if value.denominator == 1 else float(value)


def evaluate_exact(expr: str) -> Fraction:
    """The exact value of ``expr`` (see ``evaluate``)."""
    text = expr.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"too long (over {MAX_CHARS} characters)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # ValueError: a null byte; RecursionError/MemoryError: parser limits on nesting
        raise CalcError("not a valid expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"too long (over {MAX_NODES} terms and operators)")
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        v = node.value
        # bool is an int subclass: True + 1 is not arithmetic the tool offers
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CalcError(f"{type(v).__name__} literals are not allowed (numbers only)")
        if abs(v) > MAX_ABS:
            raise CalcError(f"too large (a number beyond {MAX_ABS:.0e})")
        # a float literal as written (its shortest repr): 0.1 is 1/10, not 0.1000000000000000055
        return _bounded(Fraction(repr(v)) if isinstance(v, float) else Fraction(v))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            return _bounded(left + right)
        if isinstance(node.op, ast.Sub):
            return _bounded(left - right)
        if isinstance(node.op, ast.Mult):
            return _bounded(left * right)
        if right == 0:
            raise CalcError("division by zero")
        return _bounded(left / right)
    kind = type(node.op) if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node)
    what = _REFUSED.get(kind, f"{type(node).__name__} expressions are")
    raise CalcError(f"{what} not allowed (only numbers, + - * / and parentheses)")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS:
        raise CalcError(f"too large (a result beyond {MAX_ABS:.0e})")
    return value


def format_number(value: int | float | Fraction) -> str:
    """Canonical text of a value: a whole number as an int (``4.0`` and ``Fraction(8, 2)``
    print ``4``), anything else to 6 significant digits (``1/3`` prints ``0.333333``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, Fraction) and value.denominator == 1:
        value = value.numerator
    if isinstance(value, int):
        return str(value)
    return format(float(value), ".6g")

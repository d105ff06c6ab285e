"""The built-in ``calculator`` tool: exact arithmetic on an expression, safely (no ``eval``).

Numbers, ``+ - * / // % **``, parentheses and unary signs. Mistakes (bad syntax, division by zero,
huge powers) come back as ``"error: ..."`` text for the model to read, never as exceptions.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from typing import Any

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 1000
_MAX_LENGTH = 500


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text, or ``"error: <why>"``."""
    if len(expression) > _MAX_LENGTH:
        return f"error: the expression is longer than {_MAX_LENGTH} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except (ValueError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> int | float:
    # ints and floats only: bool is an int too, but True is no number here
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (limit {_MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: only numbers and + - * / // % ** are allowed")


class Calculator:
    """A :class:`miles_contracts.Tool`."""

    name = "calculator"
    description = "Evaluate an arithmetic expression exactly, e.g. '(12 + 30) * 2'."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the expression to evaluate"}},
        "required": ["expression"],
    }

    async def __call__(self, expression: str) -> str:
        return evaluate(expression)


def openai_tool() -> dict[str, Any]:
    """The calculator as an entry of an OpenAI ``tools`` list: what an agent of its own sends."""
    return {"type": "function", "function": {"name": Calculator.name, "description": Calculator.description,
                                             "parameters": Calculator.parameters}}


def answer_call(name: str, arguments: str) -> str:
    """The tool message for a model's call ``name(arguments)`` (JSON text): the result, or an
    ``error: ...`` the model can read and recover from (a wrong name, arguments that do not parse)."""
    if name != Calculator.name:
        return f"error: there is no tool named {name!r}; use {Calculator.name}"
    try:
        expression = json.loads(arguments).get("expression")
    except (json.JSONDecodeError, AttributeError):
        return "error: arguments must be a JSON object with an 'expression' string"
    return evaluate(expression) if isinstance(expression, str) else "error: 'expression' must be a string"

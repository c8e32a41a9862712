"""The sandbox's child process (envs/sandbox.py starts it, and its docstring says what each layer
holds): run as `python -I -S -B sandbox_child.py TIMEOUT_S MEMORY_MB MAX_OUTPUT_CHARS`, it limits
its own resources, reads one expression on stdin, evaluates it with a whitelist interpreter (never
`eval`) whose size guards refuse astronomically large results before computing them, and writes
one JSON reply on stdout. It runs in a bare interpreter (no site-packages, an empty environment),
so it imports the standard library only."""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import resource
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

MAX_DEPTH = 100
MAX_INT_BITS = 10_000
MAX_ITEMS = 1_000_000
MAX_FACTORIAL_ARGUMENT = 1000
MAX_ROUND_DIGITS = 1000
# The child's CPU timer fires this long after timeout_s: pure-Python work, which the SIGALRM timer
# at timeout_s of wall time (never less than the CPU time) stops with a clean error, ends that way.
CPU_TIMER_MARGIN_S = 0.05
MEMORY_LIMIT_ERROR = "memory limit exceeded"
TRUNCATION_MARKER = "..."


# The reply's texts, also the caller's (envs/sandbox.py) where it writes a reply itself.


def timeout_error(timeout_s: float) -> str:
    return f"timeout: took longer than {float(timeout_s)} s"


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[: max_chars - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


# --- the child's life -----------------------------------------------------------------------------


class _ToolError(Exception):  # not DecentrlError: this child imports the standard library only
    """An error whose message is the whole error text the model reads."""


class _EvaluationTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that no `except Exception` on the way swallows it."""


def _raise_timeout(signal_number: int, frame: object) -> NoReturn:
    raise _EvaluationTimeout


def _serve_one_expression(arguments: list[str]) -> NoReturn:
    """The child's whole life: limit itself, read one expression on stdin, write one reply."""
    timeout_s = float(arguments[0])
    memory_mb, max_output_chars = int(arguments[1]), int(arguments[2])
    _limit_resources(timeout_s, memory_mb)
    try:
        expression = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
        reply = json.dumps(_evaluate_to_reply(expression, timeout_s, max_output_chars)).encode()
    except MemoryError:
        reply = _MEMORY_LIMIT_REPLY
    view = memoryview(reply)
    while view:
        view = view[os.write(sys.stdout.fileno(), view) :]
    # No interpreter shutdown: it is slow and has nothing left to do.
    os._exit(0)


# Built before the memory limit applies: when it is hit there may be no memory left to build it.
_MEMORY_LIMIT_REPLY = json.dumps({"ok": False, "error": MEMORY_LIMIT_ERROR}).encode()


def _limit_resources(timeout_s: float, memory_mb: int) -> None:
    memory_bytes = memory_mb * 1024 * 1024
    cpu_s = math.ceil(timeout_s)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # SIGPROF keeps its default action (end the process): no Python handler, which would only run
    # between two bytecodes, stands between the timer and the kernel.
    signal.setitimer(signal.ITIMER_PROF, timeout_s + CPU_TIMER_MARGIN_S)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _evaluate_to_reply(expression: str, timeout_s: float, max_output_chars: int) -> dict[str, Any]:
    """The reply for `expression`: {"ok": True, "output": ...} or {"ok": False, "error": ...}.
    A MemoryError propagates: the caller answers it without allocating."""
    signal.signal(signal.SIGALRM, _raise_timeout)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            output = repr(_evaluate_expression(expression))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return {"ok": True, "output": truncate(output, max_output_chars)}
    except _EvaluationTimeout:
        error = timeout_error(timeout_s)
    except _ToolError as tool_error:
        error = str(tool_error)
    except MemoryError:
        raise
    except Exception as exception:  # noqa: BLE001 - Python's own error is the model's answer
        error = f"{type(exception).__name__}: {exception}"
    return {"ok": False, "error": truncate(error, max_output_chars)}


def _evaluate_expression(expression: str) -> Any:
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise _ToolError(f"SyntaxError: {error.msg}{_location(error)}") from None
    _check_allowed(tree.body, depth=1)
    return _evaluate(tree.body)


def _location(error: SyntaxError) -> str:
    if not error.offset:  # unknown, or 0 at the end of the text
        return ""
    line = f" of line {error.lineno}" if error.lineno and error.lineno > 1 else ""
    return f" at column {error.offset}{line}"


# --- the whitelist --------------------------------------------------------------------------------

_CONSTANT_TYPES = (int, float, complex, str, bool, type(None))
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _power(base: Any, exponent: Any) -> Any:
    # An int result has about log2(|base|) * exponent bits: refuse before computing it.
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and abs(base) > 1
        and (exponent > MAX_INT_BITS or math.log2(abs(base)) * exponent > MAX_INT_BITS)
    ):
        raise _ToolError(f"too large: the result of ** would have over {MAX_INT_BITS} bits")
    return base**exponent


def _multiply(left: Any, right: Any) -> Any:
    for sequence, count in ((left, right), (right, left)):
        if (
            isinstance(sequence, str | list | tuple)
            and isinstance(count, int)
            and len(sequence) * count > MAX_ITEMS
        ):
            raise _ToolError(f"too large: the result of * would have over {MAX_ITEMS} items")
    return left * right


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        # '%999999999d' % 1 builds a gigabyte string.
        raise _ToolError("not allowed: % string formatting")
    return left % right


def _factorial(n: Any) -> Any:
    if isinstance(n, int) and n > MAX_FACTORIAL_ARGUMENT:
        raise _ToolError(f"too large: factorial() takes n <= {MAX_FACTORIAL_ARGUMENT}")
    return math.factorial(n)


def _comb(n: Any, k: Any) -> Any:
    if isinstance(n, int) and n > MAX_FACTORIAL_ARGUMENT:
        raise _ToolError(f"too large: comb() takes n <= {MAX_FACTORIAL_ARGUMENT}")
    return math.comb(n, k)


def _round(number: Any, ndigits: Any = None) -> Any:
    # round(5, -10**6) computes 10**(10**6) on the way.
    if isinstance(ndigits, int) and abs(ndigits) > MAX_ROUND_DIGITS:
        raise _ToolError(f"too large: round() takes at most {MAX_ROUND_DIGITS} digits")
    return round(number, ndigits)


@dataclass(frozen=True)
class _Function:
    run: Callable[..., Any]
    min_args: int
    max_args: int | None  # None: any number


_FUNCTIONS: dict[str, _Function] = {
    "abs": _Function(abs, 1, 1),
    "min": _Function(min, 1, None),
    "max": _Function(max, 1, None),
    "round": _Function(_round, 1, 2),
    # With no start value, sum() only adds things that add to 0: numbers.
    "sum": _Function(sum, 1, 1),
    "len": _Function(len, 1, 1),
    "int": _Function(int, 1, 2),
    "float": _Function(float, 1, 1),
    "pow": _Function(_power, 2, 2),
    "sqrt": _Function(math.sqrt, 1, 1),
    "floor": _Function(math.floor, 1, 1),
    "ceil": _Function(math.ceil, 1, 1),
    "gcd": _Function(math.gcd, 1, None),
    "lcm": _Function(math.lcm, 1, None),
    "factorial": _Function(_factorial, 1, 1),
    "comb": _Function(_comb, 2, 2),
    "log": _Function(math.log, 1, 2),
    "log2": _Function(math.log2, 1, 1),
    "log10": _Function(math.log10, 1, 1),
    "exp": _Function(math.exp, 1, 1),
    "sin": _Function(math.sin, 1, 1),
    "cos": _Function(math.cos, 1, 1),
    "tan": _Function(math.tan, 1, 1),
}

_UNARY_OPERATORS: dict[type[ast.AST], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
    ast.Not: operator.not_,
}
_BINARY_OPERATORS: dict[type[ast.AST], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: _multiply,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: _modulo,
    ast.Pow: _power,
}
_COMPARISONS: dict[type[ast.AST], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda item, container: item in container,
    ast.NotIn: lambda item, container: item not in container,
}
_ALLOWED_OPERATORS = {*_UNARY_OPERATORS, *_BINARY_OPERATORS, *_COMPARISONS, ast.And, ast.Or}
_REFUSED_OPERATOR_SYMBOLS: dict[type[ast.AST], str] = {
    ast.Invert: "~",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.MatMult: "@",
    ast.Is: "is",
    ast.IsNot: "is not",
}
_DISPLAYS: dict[type[ast.AST], Callable[[Any], Any]] = {
    ast.Tuple: tuple,
    ast.List: list,
    ast.Set: set,
}
_ALLOWED_NODES = (
    ast.Constant, ast.Name, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp,
    ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Call,
)  # fmt: skip
_REFUSED_NODE_NAMES: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access",
    ast.Subscript: "subscripts",
    ast.Lambda: "lambda",
    ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions",
    ast.GeneratorExp: "comprehensions",
    ast.NamedExpr: "assignment (:=)",
    ast.JoinedStr: "f-strings",
    ast.Starred: "* unpacking",
}


def _check_allowed(node: ast.expr, depth: int) -> None:
    """Raise _ToolError unless `node` and everything under it is on the whitelist."""
    if depth > MAX_DEPTH:
        raise _ToolError(f"not allowed: expressions nested more than {MAX_DEPTH} levels deep")
    if not isinstance(node, _ALLOWED_NODES):
        name = _REFUSED_NODE_NAMES.get(type(node), type(node).__name__)
        raise _ToolError(f"not allowed: {name}")
    if isinstance(node, ast.Constant) and not isinstance(node.value, _CONSTANT_TYPES):
        raise _ToolError(f"not allowed: {type(node.value).__name__} literals")
    if isinstance(node, ast.Name):
        if node.id in _FUNCTIONS:
            raise _ToolError(f"not allowed: {node.id} is a function; call it, as in {node.id}(x)")
        if node.id not in _CONSTANTS:
            raise _ToolError(f"NameError: name {node.id!r} is not defined")
    if isinstance(node, ast.UnaryOp | ast.BinOp | ast.BoolOp):
        _check_operator(node.op)
    if isinstance(node, ast.Compare):
        for comparison in node.ops:
            _check_operator(comparison)
    if isinstance(node, ast.Dict) and None in node.keys:
        raise _ToolError("not allowed: ** unpacking")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            _check_allowed(node.func, depth + 1)  # the more telling error when it has one
            raise _ToolError("not allowed: calling anything but a function by its name")
        if node.func.id not in _FUNCTIONS:
            raise _ToolError(f"NameError: name {node.func.id!r} is not defined")
        if node.keywords:
            raise _ToolError("not allowed: keyword arguments")
    # A call's function name is not checked as a value: that is the one place a function may be.
    children = node.args if isinstance(node, ast.Call) else ast.iter_child_nodes(node)
    for child in children:
        if isinstance(child, ast.expr):
            _check_allowed(child, depth + 1)


def _check_operator(op: ast.AST) -> None:
    if type(op) not in _ALLOWED_OPERATORS:
        symbol = _REFUSED_OPERATOR_SYMBOLS.get(type(op), type(op).__name__)
        raise _ToolError(f"not allowed: the {symbol} operator")


def _evaluate(node: ast.expr) -> Any:
    """The value of a tree that passed _check_allowed, evaluated the way Python would."""
    match node:
        case ast.Constant(value=value):
            return _bounded(value)
        case ast.Name(id=name):
            return _CONSTANTS[name]
        case ast.UnaryOp(op=op, operand=operand):
            return _bounded(_UNARY_OPERATORS[type(op)](_evaluate(operand)))
        case ast.BinOp(left=left, op=op, right=right):
            return _bounded(_BINARY_OPERATORS[type(op)](_evaluate(left), _evaluate(right)))
        case ast.BoolOp(op=op, values=[first, *rest]):
            # `or` stops at the first true value, `and` at the first false one.
            stop_at = isinstance(op, ast.Or)
            value = _evaluate(first)
            for value_node in rest:
                if bool(value) is stop_at:
                    break
                value = _evaluate(value_node)
            return value
        case ast.Compare(left=left, ops=ops, comparators=comparators):
            left_value = _evaluate(left)
            for comparison, comparator in zip(ops, comparators, strict=True):
                right_value = _evaluate(comparator)
                if not _COMPARISONS[type(comparison)](left_value, right_value):
                    return False
                left_value = right_value
            return True
        case ast.IfExp(test=test, body=body, orelse=orelse):
            return _evaluate(body if _evaluate(test) else orelse)
        case ast.Tuple(elts=elements) | ast.List(elts=elements) | ast.Set(elts=elements):
            return _DISPLAYS[type(node)](_evaluate(element) for element in elements)
        case ast.Dict(keys=keys, values=values):
            return {_evaluate(key): _evaluate(value) for key, value in zip(keys, values)}
        case ast.Call(func=ast.Name(id=name), args=args):
            return _bounded(_call(name, [_evaluate(argument) for argument in args]))
    raise AssertionError(f"{type(node).__name__} passed the whitelist but has no evaluation")


def _call(name: str, arguments: list[Any]) -> Any:
    function = _FUNCTIONS[name]
    if len(arguments) < function.min_args or (
        function.max_args is not None and len(arguments) > function.max_args
    ):
        if function.max_args is None:
            expected = f"at least {function.min_args}"
        elif function.max_args == function.min_args:
            expected = str(function.min_args)
        else:
            expected = f"{function.min_args} to {function.max_args}"
        plural = "" if expected == "1" else "s"
        raise _ToolError(
            f"TypeError: {name}() takes {expected} argument{plural}, got {len(arguments)}"
        )
    return function.run(*arguments)


def _bounded(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _ToolError(f"too large: integers are limited to {MAX_INT_BITS} bits")
    if isinstance(value, str | list | tuple | set | dict) and len(value) > MAX_ITEMS:
        raise _ToolError(f"too large: strings and collections are limited to {MAX_ITEMS} items")
    return value


if __name__ == "__main__":
    _serve_one_expression(sys.argv[1:])

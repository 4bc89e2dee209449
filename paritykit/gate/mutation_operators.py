"""The mutation operators of `paritykit mutate`: Cosmic Ray's, plus four it lacks, in Cosmic Ray's own
operator protocol (``mutation_positions(node)`` and ``mutate(node, index)`` over a parso tree), so one
walk and Cosmic Ray's ``mutate_code`` apply them all.

From Cosmic Ray, restricted to replacements a real bug makes (docs/coverage.md says why):
- wrong operator: binary operators replaced within their family (``+ - * / // %``; ``& | ^``; ``<< >>``);
- inverted conditions: comparisons within their family (``== != < <= > >=``; ``is``/``is not``),
  ``not`` added to a condition or removed, ``and``/``or`` swapped, ``True``/``False`` swapped;
- changed constant: every number +1 and -1; ``break``/``continue`` swapped; a for loop run zero times.
Added here:
- ``SwapArguments``: two adjacent positional arguments of a call swapped;
- ``DropKeywordArgument``: one keyword argument of a call left out (the callee's default applies);
- ``RemoveStatement``: an assignment or an expression statement replaced by ``pass``;
- ``SliceBoundOffByOne``: a slice bound moved by one (``x[a:b]`` -> ``x[a:(b) + 1]``).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import parso
from parso.python.tree import Operator as ParsoOperator

Position = tuple[tuple[int, int], tuple[int, int]]

_FAMILIES = ({"Add", "Sub", "Mul", "Div", "FloorDiv", "Mod"}, {"BitOr", "BitAnd", "BitXor"}, {"LShift", "RShift"},
             {"Eq", "NotEq", "Lt", "LtE", "Gt", "GtE"}, {"Is", "IsNot"})
_KEPT_COSMIC_RAY = {
    "AddNot", "ReplaceTrueWithFalse", "ReplaceFalseWithTrue", "ReplaceAndWithOr", "ReplaceOrWithAnd",
    "ReplaceBreakWithContinue", "ReplaceContinueWithBreak", "NumberReplacer", "ZeroIterationForLoop",
    "ReplaceUnaryOperator_Delete_Not", "ReplaceUnaryOperator_Delete_USub", "ReplaceUnaryOperator_USub_UAdd",
}


def _kept(name: str) -> bool:
    short = name.split("/")[-1]
    for prefix in ("ReplaceBinaryOperator_", "ReplaceComparisonOperator_"):
        if short.startswith(prefix):
            pair = short[len(prefix):].split("_")
            return len(pair) == 2 and any(set(pair) <= family for family in _FAMILIES)
    return short in _KEPT_COSMIC_RAY


def _prefix(node: Any) -> str:
    """The whitespace and comments before a node (held by its first leaf)."""
    return node.get_first_leaf().prefix


def _set_prefix(node: Any, prefix: str) -> None:
    node.get_first_leaf().prefix = prefix


def _call_arguments(node: Any) -> list[Any]:
    """The argument nodes of a call trailer ``( ... )`` (commas left out), else []."""
    if node.type != "trailer" or node.children[0] != "(" or len(node.children) != 3:
        return []
    inner = node.children[1]
    if inner.type == "arglist":
        return [child for child in inner.children if child != ","]
    return [inner]


def _is_keyword(argument: Any) -> bool:
    return argument.type == "argument" and len(argument.children) == 3 and argument.children[1] == "="


def _is_positional(argument: Any) -> bool:
    # Starred arguments and generator arguments are neither; a keyword argument is an `argument` too.
    return argument.type != "argument" and not (argument.type == "star_expr")


class SwapArguments:
    """Two adjacent positional arguments of a call swapped: ``f(a, b)`` -> ``f(b, a)``."""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        positional = [arg for arg in _call_arguments(node) if _is_positional(arg)]
        for first, second in zip(positional, positional[1:]):
            if first.get_code().strip() != second.get_code().strip():
                yield (first.start_pos, second.end_pos)

    def mutate(self, node: Any, index: int) -> Any:
        positional = [arg for arg in _call_arguments(node) if _is_positional(arg)]
        pairs = [(a, b) for a, b in zip(positional, positional[1:]) if a.get_code().strip() != b.get_code().strip()]
        first, second = pairs[index]
        siblings = first.parent.children
        i, j = siblings.index(first), siblings.index(second)
        siblings[i], siblings[j] = second, first
        prefix_first, prefix_second = _prefix(first), _prefix(second)
        _set_prefix(first, prefix_second)
        _set_prefix(second, prefix_first)
        return node


class DropKeywordArgument:
    """One keyword argument of a call left out: ``f(a, eps=x)`` -> ``f(a)``."""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        for argument in _call_arguments(node):
            if _is_keyword(argument):
                yield (argument.start_pos, argument.end_pos)

    def mutate(self, node: Any, index: int) -> Any:
        argument = [arg for arg in _call_arguments(node) if _is_keyword(arg)][index]
        if argument.parent is node:  # the only argument
            node.children = [node.children[0], node.children[2]]
            return node
        siblings = argument.parent.children
        at = siblings.index(argument)
        # Take the comma after it, or before it when it is the last argument.
        drop = {at, at + 1} if at + 1 < len(siblings) else {at, at - 1}
        argument.parent.children = [child for k, child in enumerate(siblings) if k not in drop]
        return node


class RemoveStatement:
    """An assignment or an expression statement (a call, mostly) replaced by ``pass``."""

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        if node.type == "simple_stmt" and len(node.children) == 2 and _removable(node.children[0]):
            yield (node.children[0].start_pos, node.children[0].end_pos)

    def mutate(self, node: Any, index: int) -> Any:
        statement = node.children[0]
        node.children[0] = parso.python.tree.Keyword("pass", statement.start_pos, prefix=_prefix(statement))
        return node


def _removable(statement: Any) -> bool:
    if statement.type == "expr_stmt":
        # `x: T` alone declares a type and does nothing at run time.
        return any((child.type == "operator" and child.value.endswith("=")) or
                   (child.type == "annassign" and "=" in [c.value for c in child.children if c.type == "operator"])
                   for child in statement.children[1:])
    # An expression statement that calls something (not a docstring, not `...`).
    return statement.type in ("atom_expr", "power") and any(
        child.type == "trailer" and child.children[0] == "(" for child in statement.children)


class SliceBoundOffByOne:
    """A slice bound moved by one, each way: ``x[a:b]`` -> ``x[a:(b) + 1]`` and ``x[a:(b) - 1]``."""

    OFFSETS = (" + 1", " - 1")

    def mutation_positions(self, node: Any) -> Iterator[Position]:
        for bound in _slice_bounds(node):
            for _ in self.OFFSETS:
                yield (bound.start_pos, bound.end_pos)

    def mutate(self, node: Any, index: int) -> Any:
        bound = _slice_bounds(node)[index // len(self.OFFSETS)]
        code = f"{_prefix(bound)}({bound.get_code(include_prefix=False)}){self.OFFSETS[index % len(self.OFFSETS)]}"
        replacement = parso.parse(code).children[0]
        siblings = bound.parent.children
        siblings[siblings.index(bound)] = replacement
        replacement.parent = bound.parent
        return node


def _slice_bounds(node: Any) -> list[Any]:
    if node.type != "subscript":
        return []
    return [child for child in node.children if not (isinstance(child, ParsoOperator) and child.value == ":")
            and child.type != "sliceop"]


OWN_OPERATORS = {"paritykit/SwapArguments": SwapArguments, "paritykit/DropKeywordArgument": DropKeywordArgument,
                 "paritykit/RemoveStatement": RemoveStatement, "paritykit/SliceBoundOffByOne": SliceBoundOffByOne}


@functools.lru_cache(maxsize=1)
def operators() -> dict[str, Any]:
    """{name: operator instance}: the kept Cosmic Ray operators, then paritykit's own."""
    import cosmic_ray.plugins

    found = {name: cosmic_ray.plugins.get_operator(name)() for name in sorted(cosmic_ray.plugins.operator_names())
             if _kept(name) and not cosmic_ray.plugins.get_operator(name).arguments()}
    found.update({name: cls() for name, cls in OWN_OPERATORS.items()})
    return found


def mutate_source(source: str, operator_name: str, occurrence: int) -> str | None:
    """The source with the ``occurrence``-th position of the operator mutated (None: no such position)."""
    from cosmic_ray.mutating import mutate_code

    return mutate_code(source, operators()[operator_name], occurrence)

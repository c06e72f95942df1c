"""A label selector checked the way the Kubernetes API server parses one, so that
``tft-bridge node --check`` refuses what the server would answer 400 to (the service
would otherwise retry its list forever).

The grammar (apimachinery's ``labels.Parse``): requirements separated by commas, each
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (v1,v2)``,
``key notin (v1,v2)``, ``key>N`` or ``key<N``. A key is a qualified name (an optional DNS
subdomain prefix and ``/``, then a name of at most 63 characters); a value is empty or a
name of at most 63 characters. ``selector_problem`` returns the first problem, or None.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SPECIAL = frozenset(" \t\n\r(),=!<>")
_OPERATORS = ("==", "!=", "=", "!", "(", ")", ",", "<", ">")


def _tokens(text: str) -> list[str]:
    """Identifiers and operators, as the server's lexer splits them."""
    tokens: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in " \t\n\r":
            i += 1
            continue
        operator = next((op for op in _OPERATORS if text.startswith(op, i)), None)
        if operator is not None:
            tokens.append(operator)
            i += len(operator)
            continue
        start = i
        while i < len(text) and text[i] not in _SPECIAL:
            i += 1
        tokens.append(text[start:i])
    return tokens


def key_problem(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix)):
        return f"the key {key!r} has an invalid prefix: a lower-case DNS subdomain (at most 253 characters) is needed"
    if not name or len(name) > 63 or not _NAME.fullmatch(name):
        return (f"the key {key!r} is not a valid label name: at most 63 characters, alphanumeric at both ends, "
                f"'-', '_' and '.' between")
    return None


def value_problem(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME.fullmatch(value)):
        return (f"the value {value!r} is not a valid label value: empty, or at most 63 characters, alphanumeric "
                f"at both ends, '-', '_' and '.' between")
    return None


def _is_identifier(token: str | None) -> bool:
    return token is not None and token not in _OPERATORS


def selector_problem(text: str) -> str | None:
    """Why the API server would refuse ``text`` as a label selector (None: it parses)."""
    tokens = _tokens(text)
    if not tokens:
        return "empty: the service would serve every pod of the node"
    i = 0

    def peek(offset: int = 0) -> str | None:
        return tokens[i + offset] if i + offset < len(tokens) else None

    while True:
        if peek() == "!":
            i += 1
            key = peek()
            if not _is_identifier(key):
                return f"'!' must be followed by a label key, found {key or 'the end'!r}"
            i += 1
            if (why := key_problem(str(key))) is not None:
                return why
        else:
            key = peek()
            if not _is_identifier(key):
                return f"expected a label key, found {key or 'the end'!r}"
            i += 1
            if (why := key_problem(str(key))) is not None:
                return why
            operator = peek()
            if operator in ("=", "==", "!="):
                i += 1
                value = peek()
                if _is_identifier(value):
                    i += 1
                    if (why := value_problem(str(value))) is not None:
                        return why
                elif value not in (None, ","):
                    return f"found {value!r} after {key}{operator}, expected a value, ',' or the end"
            elif operator in ("in", "notin"):
                i += 1
                if peek() != "(":
                    return f"'{operator}' must be followed by '(', found {peek() or 'the end'!r}"
                i += 1
                values: list[str] = []
                while True:
                    value = peek()
                    if _is_identifier(value):
                        values.append(str(value))
                        i += 1
                        if (why := value_problem(str(value))) is not None:
                            return why
                        value = peek()
                    if value == ",":
                        i += 1
                        continue
                    if value == ")":
                        i += 1
                        break
                    return f"found {value or 'the end'!r} in the values of {key} {operator}, expected ',' or ')'"
                if not values:
                    return f"the values of {key} {operator} (...) cannot be empty"
            elif operator in ("<", ">"):
                i += 1
                value = peek()
                if not _is_identifier(value) or not re.fullmatch(r"-?[0-9]+", str(value)):
                    return f"{key}{operator} needs an integer, found {value or 'the end'!r}"
                i += 1
            elif operator not in (None, ","):
                return f"found {operator!r} after the key {key!r}, expected '=', '==', '!=', 'in', 'notin', ',' " \
                       f"or the end"
        nxt = peek()
        if nxt is None:
            return None
        if nxt != ",":
            return f"found {nxt!r}, expected ',' or the end of the selector"
        i += 1

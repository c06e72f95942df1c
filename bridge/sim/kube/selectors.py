"""Label and field selectors parsed as the Kubernetes API server parses them.

Label selectors (``apimachinery/pkg/labels``): comma-separated requirements, each
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (a,b)``,
``key notin (a,b)``, ``key>N``, ``key<N``; keys are qualified names (an optional DNS
subdomain prefix and ``/``, then at most 63 characters), values at most 63
characters. Anything else (``a=b=c``, a trailing comma, ``in ()``) is a 400.

Field selectors (``apimachinery/pkg/fields``): comma-separated ``path=value``,
``path==value``, ``path!=value`` terms (no set-based terms); and only the fields the
resource declares selectable (a Pod's ``spec.nodeName``, ``status.phase``, ...), any
other (``status.hostIP``) is a 400 ``field label not supported``.

:class:`SelectorError` carries the message; the stand-in answers it as a 400 Status.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Field labels each resource accepts in a fieldSelector (the server's own lists).
SELECTABLE_FIELDS: dict[str, frozenset[str]] = {
    "pods": frozenset({"metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy",
                       "spec.schedulerName", "spec.serviceAccountName", "spec.hostNetwork", "status.phase",
                       "status.podIP", "status.podIPs", "status.nominatedNodeName"}),
    "events": frozenset({"metadata.name", "metadata.namespace", "involvedObject.kind",
                         "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
                         "involvedObject.apiVersion", "involvedObject.resourceVersion",
                         "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"}),
}
#: What every other resource (a custom resource such as a PodGroup) accepts.
DEFAULT_FIELDS = frozenset({"metadata.name", "metadata.namespace"})

_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SPECIAL = "!=(),<>"


class SelectorError(ValueError):
    """A selector the server refuses (HTTP 400)."""


def _key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        return f"prefix part must be non-empty in {key!r}"
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"prefix part {prefix!r} must be a DNS-1123 subdomain"
    if not name or len(name) > 63 or not _NAME.match(name):
        return (f"name part of {key!r} must consist of alphanumeric characters, '-', '_' or '.', and must start "
                "and end with an alphanumeric character (at most 63 characters)")
    return None


def _value_problem(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME.match(value)):
        return (f"values[0]: Invalid value: {value!r}: a valid label must be an empty string or consist of "
                "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")
    return None


def _lex(text: str) -> list[tuple[str, str]]:
    """(kind, text) tokens: ID, OP (one of ! = == != ( ) , < >), then END."""
    tokens: list[tuple[str, str]] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
        elif ch in _SPECIAL:
            two = text[i:i + 2]
            if two in ("==", "!="):
                tokens.append(("OP", two))
                i += 2
            else:
                tokens.append(("OP", ch))
                i += 1
        else:
            start = i
            while i < len(text) and not text[i].isspace() and text[i] not in _SPECIAL:
                i += 1
            tokens.append(("ID", text[start:i]))
    tokens.append(("END", ""))
    return tokens


def _describe(token: tuple[str, str]) -> str:
    return "end of string" if token[0] == "END" else repr(token[1])


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !exists, =, !=, in, notin, gt, lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key, "")
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        try:
            number = int(value)
        except ValueError:
            return False
        bound = int(self.values[0])
        return present and (number > bound if self.op == "gt" else number < bound)


@dataclass(frozen=True)
class LabelSelector:
    """A parsed label selector: every requirement must hold."""

    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        tokens = _lex(text or "")
        pos = 0

        def peek() -> tuple[str, str]:
            return tokens[pos]

        def take() -> tuple[str, str]:
            nonlocal pos
            token = tokens[pos]
            pos = min(pos + 1, len(tokens) - 1)
            return token

        def fail(found: tuple[str, str], expected: str) -> SelectorError:
            return SelectorError(f"unable to parse requirement: found {_describe(found)}, expected: {expected}")

        requirements: list[Requirement] = []
        if peek()[0] == "END":
            return cls(())
        while True:
            negated = peek() == ("OP", "!")
            if negated:
                take()
            token = take()
            if token[0] != "ID":
                raise fail(token, "identifier")
            key = token[1]
            problem = _key_problem(key)
            if problem:
                raise SelectorError(f"unable to parse requirement: key: Invalid value: {key!r}: {problem}")
            nxt = peek()
            if nxt[0] == "END" or nxt == ("OP", ","):
                requirements.append(Requirement(key, "!exists" if negated else "exists"))
            elif negated:
                raise fail(nxt, "',' or 'end of string'")
            else:
                op_token = take()
                op = {"=": "=", "==": "=", "!=": "!=", "<": "lt", ">": "gt"}.get(op_token[1]) \
                    if op_token[0] == "OP" else {"in": "in", "notin": "notin"}.get(op_token[1])
                if op is None:
                    raise fail(op_token, "'=', '!=', '==', 'in', 'notin', '<' or '>'")
                if op in ("in", "notin"):
                    if take() != ("OP", "("):
                        raise SelectorError(f"unable to parse requirement: found {_describe(tokens[pos - 1])}, "
                                            "expected: '('")
                    values: list[str] = []
                    expect_value = True
                    while True:
                        token = take()
                        if token == ("OP", ")"):
                            if expect_value and values:
                                values.append("")
                            break
                        if token == ("OP", ","):
                            if expect_value:
                                values.append("")
                            expect_value = True
                        elif token[0] == "ID" and expect_value:
                            values.append(token[1])
                            expect_value = False
                        else:
                            raise fail(token, "',' or ')'")
                    if not values:
                        raise SelectorError(f"unable to parse requirement: values: Invalid value: {key!r}: for "
                                            "'in', 'notin' operators, values set can't be empty")
                else:
                    nxt = peek()
                    if nxt[0] == "END" or nxt == ("OP", ","):
                        values = [""]
                    elif nxt[0] == "ID":
                        values = [take()[1]]
                    else:
                        raise fail(nxt, "identifier")
                    if op in ("gt", "lt"):
                        try:
                            int(values[0])
                        except ValueError:
                            raise SelectorError(f"unable to parse requirement: for 'Gt', 'Lt' operators, the value "
                                                f"must be an integer, got {values[0]!r}") from None
                for value in values:
                    problem = None if op in ("gt", "lt") else _value_problem(value)
                    if problem:
                        raise SelectorError(f"unable to parse requirement: {problem}")
                requirements.append(Requirement(key, op, tuple(values)))
            token = take()
            if token[0] == "END":
                break
            if token != ("OP", ","):
                raise fail(token, "',' or 'end of string'")
            if peek()[0] != "ID" and peek() != ("OP", "!"):
                raise fail(peek(), "identifier")
        return cls(tuple(requirements))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)


def _split_unescaped(text: str, separator: str) -> list[str]:
    parts, current, escaped = [], [], False
    for ch in text:
        if escaped:
            current.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == separator:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    out, escaped = [], False
    for ch in text:
        if escaped:
            if ch not in "\\,=":
                raise SelectorError(f"invalid field selector: invalid escape sequence \\{ch}")
            out.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",=":
            raise SelectorError(f"invalid field selector: unescaped {ch!r} in value")
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class FieldSelector:
    """Equality terms on a resource's selectable fields (``spec.nodeName=node-1``)."""

    terms: tuple[tuple[str, str, str], ...] = ()  # (op, path, value), op in = !=

    @classmethod
    def parse(cls, text: str | None, resource: str | None = None) -> FieldSelector:
        terms: list[tuple[str, str, str]] = []
        if not (text or "").strip():
            return cls(())
        allowed = SELECTABLE_FIELDS.get(resource or "", DEFAULT_FIELDS) if resource else None
        for term in _split_unescaped(text or "", ","):
            for op in ("!=", "==", "="):
                if op in term:
                    path, value = term.split(op, 1)
                    break
            else:
                raise SelectorError(f"invalid selector: '{text}'; can't understand '{term}'")
            path = path.strip()
            if allowed is not None and path not in allowed:
                raise SelectorError(f'field label not supported: {path}')
            terms.append(("!=" if op == "!=" else "=", path, _unescape(value)))
        return cls(tuple(terms))

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        for op, path, value in self.terms:
            current: Any = obj or {}
            if path == "source":
                path = "source.component"
            for part in path.split("."):
                current = current.get(part) if isinstance(current, Mapping) else None
            text = ("true" if current else "false") if isinstance(current, bool) else \
                "" if current is None else str(current)
            if (op == "=") != (text == value):
                return False
        return True

"""Label and field selectors as the API server reads them from a list or watch request.

Labels: apimachinery ``pkg/labels/selector.go`` ``Parse`` — requirements separated by commas, each
``key``, ``!key``, ``key=value``, ``key==value``, ``key!=value``, ``key in (a,b)`` or ``key notin (a,b)``
(``!=`` and ``notin`` also match objects without the key). An unparsable selector is a 400 BadRequest
naming it (``unable to parse requirement: ...``), as the real server answers.

Fields: every resource supports ``metadata.name`` and ``metadata.namespace`` (``pkg/registry/generic``
``DefaultClusterScopedAttr``/``DefaultNamespaceScopedAttr``), with ``=``, ``==`` and ``!=``; pods add
``spec.nodeName`` and ``status.phase`` (among others); events add the involved object's fields and
``reason``/``type`` (``pkg/apis/core/v1/conversion.go`` ``AddFieldLabelConversionsForEvent``). Anything else
is 400 ``field label not supported``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tests.cluster.apierrors import Rejection, status_body

Selector = Callable[[dict], bool]

_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_SET = re.compile(r"^\s*(?P<key>[^\s!=(),]+)\s+(?P<op>in|notin)\s+\((?P<values>[^()]*)\)\s*$")
_COMPARE = re.compile(r"^\s*(?P<key>[^\s!=(),]+)\s*(?P<op>==|!=|=)\s*(?P<value>[^\s!=(),]*)\s*$")
_EXISTS = re.compile(r"^\s*(?P<neg>!?)\s*(?P<key>[^\s!=(),]+)\s*$")

_EVENT_FIELDS = {"involvedObject.kind": ("involvedObject", "kind"), "involvedObject.name": ("involvedObject", "name"),
                 "involvedObject.namespace": ("involvedObject", "namespace"),
                 "involvedObject.uid": ("involvedObject", "uid"), "reason": ("reason",), "type": ("type",)}
_COMMON_FIELDS = {"metadata.name": ("metadata", "name"), "metadata.namespace": ("metadata", "namespace")}
#: pkg/registry/core/pod/strategy.go ``PodToSelectableFields`` (some): what ``kubectl drain`` lists a node's
#: pods by (``spec.nodeName=<node>``).
_POD_FIELDS = {"spec.nodeName": ("spec", "nodeName"), "status.phase": ("status", "phase"),
               "spec.restartPolicy": ("spec", "restartPolicy"), "spec.schedulerName": ("spec", "schedulerName")}


def _bad(message: str) -> Rejection:
    return Rejection(400, status_body(400, "BadRequest", message))


def _requirements(selector: str) -> list[str]:
    """Split at the commas outside parentheses (``a in (x,y),b`` is two requirements)."""
    parts, depth, current = [], 0, ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part for part in parts if part.strip()]


def label_selector(selector: str) -> Selector:
    """A predicate on an object's labels, or a 400 for a selector the API server would not parse."""
    tests: list[Callable[[dict], bool]] = []
    for requirement in _requirements(selector or ""):
        if match := _SET.match(requirement):
            key, values = match["key"], {v.strip() for v in match["values"].split(",") if v.strip()}
            if not values:
                raise _bad("unable to parse requirement: for 'in', 'notin' operators, values set can't be empty")
            if match["op"] == "in":
                tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif match := _COMPARE.match(requirement):
            key, value, op = match["key"], match["value"], match["op"]
            if op == "!=":
                tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif match := _EXISTS.match(requirement):
            key, negated = match["key"], bool(match["neg"])
            tests.append(lambda labels, k=key, n=negated: (k in labels) != n)
        else:
            raise _bad(f"unable to parse requirement: found '{requirement.strip()}', expected: in, notin, =, ==, "
                       "!=, gt, lt")
        if not _KEY.match(match["key"]):
            raise _bad(f'unable to parse requirement: invalid label key "{match["key"]}": name part must consist of '
                       "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
                       "character")

    def matches(obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(test(labels) for test in tests)
    return matches


def field_selector(resource: str, selector: str) -> Selector:
    """A predicate on an object's fields, or a 400 naming a field label the resource does not support."""
    known = {**_COMMON_FIELDS, **(_EVENT_FIELDS if resource == "events" else {}),
             **(_POD_FIELDS if resource == "pods" else {})}
    tests: list[tuple[tuple[str, ...], str, bool]] = []
    for requirement in _requirements(selector or ""):
        match = _COMPARE.match(requirement)
        if match is None:
            raise _bad(f"invalid selector: '{selector}'; can't understand '{requirement.strip()}'")
        if match["key"] not in known:
            raise _bad(f"field label not supported: {match['key']}")
        tests.append((known[match["key"]], match["value"], match["op"] == "!="))

    def value_at(obj: dict, path: tuple[str, ...]) -> Any:
        for part in path:
            obj = (obj or {}).get(part)
        return "" if obj is None else str(obj)

    def matches(obj: dict) -> bool:
        return all((value_at(obj, path) == value) != negated for path, value, negated in tests)
    return matches


def label_selector_object(selector: dict) -> Selector:
    """A ``metav1.LabelSelector`` (``matchLabels`` and ``matchExpressions`` with In, NotIn, Exists,
    DoesNotExist: apimachinery ``LabelSelectorAsSelector``) as a predicate on an object's labels; an empty one
    matches everything, as upstream (callers that want "nothing" check for emptiness first)."""
    wanted = dict(selector.get("matchLabels") or {})
    expressions = list(selector.get("matchExpressions") or [])

    def holds(expression: dict, labels: dict[str, str]) -> bool:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator == "In":
            return labels.get(key) in values
        if operator == "NotIn":
            return labels.get(key) not in values
        if operator == "Exists":
            return key in labels
        if operator == "DoesNotExist":
            return key not in labels
        raise _bad(f'"{operator}" is not a valid label selector operator')

    def matches(obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(labels.get(k) == v for k, v in wanted.items()) and all(holds(e, labels) for e in expressions)
    return matches

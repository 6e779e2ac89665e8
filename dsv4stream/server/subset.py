"""The JSON-Schema subset that structured output and strict tools enforce, checked before compiling.

Owns: `normalize(schema, where)`, run on every schema a request asks the grammar to follow
(a `response_format`, a strict tool's `parameters`). It walks every subschema the answer can
reach and returns an equivalent schema llguidance compiles, or raises `GrammarError` (a 400)
with one sentence naming the place and the reason. Each JSON-Schema keyword is in one of
three sets, and docs/serving.md lists them:

- `ENFORCED`: the grammar holds every answer to it (llguidance's JSON compiler);
- `ANNOTATIONS`: says nothing about which values are valid (title, description, ...);
- `REFUSED` (and any keyword in neither set): the grammar cannot hold an answer to it, so
  the schema is refused rather than the keyword ignored ("the answer validates" would fail).

References: every `$ref` is local (`#`, a JSON pointer `#/a/b` with `~0`/`~1` and %-escapes,
or a `$anchor` name); each target becomes one entry of a flat `$defs` and each `$ref` points
there, so a part of the schema (one strict-tool parameter) keeps every target it needs.

A schema with no finite value (a `$ref` cycle, an object whose required property needs the
object itself, `minItems` over items that have none) gives the grammar no complete answer:
the model would write `{"` and run out of tokens. Such schemas are refused: the targets'
"productive" set is computed as a least fixed point (a target is productive once one of its
values needs only productive targets), the standard test for a grammar's non-terminals from
which a finite string derives.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from ..errors import UsageError


class GrammarError(UsageError):
    """A response_format or tool schema the grammar compiler refuses."""


# keywords the grammar enforces on every answer
ENFORCED = frozenset({
    "type", "enum", "const", "$ref", "$defs", "definitions",
    "anyOf", "allOf",
    "properties", "required", "additionalProperties", "patternProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "additionalItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})  # fmt: skip
# keywords that only describe or label a value (valid values are the same without them)
ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
})  # fmt: skip
# keywords refused, with what to do instead
REFUSED = {
    "oneOf": "use anyOf (the grammar cannot make the alternatives exclusive)",
    "not": "the grammar cannot exclude a schema",
    "if": "conditional schemas cannot be enforced", "then": "conditional schemas cannot be enforced",
    "else": "conditional schemas cannot be enforced",
    "contains": "the grammar cannot require an item to match", "minContains": "contains is not enforced",
    "maxContains": "contains is not enforced",
    "uniqueItems": "the grammar cannot compare items",
    "dependentRequired": "list the properties in required", "dependentSchemas": "use anyOf",
    "dependencies": "list the properties in required",
    "propertyNames": "give the names in properties or a patternProperties pattern",
    "unevaluatedProperties": "use additionalProperties", "unevaluatedItems": "use items",
    "$dynamicRef": "use $ref", "$dynamicAnchor": "use $anchor", "$recursiveRef": "use $ref",
    "$recursiveAnchor": "use $anchor",
    "x-guidance": "the grammar's options are the server's",
}  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # keyword -> {name: schema}
_SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")  # keyword -> [schema]
_SCHEMA_ONE = ("additionalProperties", "additionalItems")  # keyword -> schema
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def normalize(schema: Any, where: str) -> dict[str, Any]:
    """`schema` with every local `$ref` pointing into one flat `$defs` (refused: see the module)."""
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{where}: a JSON schema must be an object")
    return _Normalizer(schema, where).run()


def pointer_tokens(fragment: str) -> list[str]:
    """The reference tokens of a JSON pointer fragment (`/a~1b/0` -> ["a/b", "0"]; RFC 6901)."""
    if not fragment:
        return []
    if not fragment.startswith("/"):
        raise ValueError(fragment)
    return [t.replace("~1", "/").replace("~0", "~") for t in unquote(fragment)[1:].split("/")]


class _Normalizer:
    def __init__(self, root: Mapping[str, Any], where: str) -> None:
        self.root, self.where = root, where
        self.names: dict[str, str] = {}  # a target's pointer -> its name in the flat $defs
        self.defs: dict[str, Any] = {}
        self.todo: list[tuple[str, Any]] = []
        self.anchors: dict[str, list[str]] = {}  # an $anchor's name -> the pointer's tokens
        self._find_anchors(root, [])

    def run(self) -> dict[str, Any]:
        out = self._schema(self.root, "")
        while self.todo:
            ptr, node = self.todo.pop()
            self.defs[self.names[ptr]] = self._schema(node, ptr)
        if self.defs:
            out = {**out, "$defs": self.defs}
        _check_finite(out, {v: k for k, v in self.names.items()}, self.where)
        return out

    def _at(self, ptr: str) -> str:
        return f"{self.where}{ptr.replace('/', '.')}" if ptr else self.where

    def _find_anchors(self, node: Any, at: list[str]) -> None:
        if isinstance(node, Mapping):
            if isinstance(node.get("$anchor"), str):
                self.anchors[node["$anchor"]] = at
            for k, v in node.items():
                if k not in ("enum", "const", "default", "examples"):
                    self._find_anchors(v, [*at, str(k)])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                self._find_anchors(v, [*at, str(i)])

    def _ref(self, ref: Any, ptr: str) -> str:
        """The flat `$defs` name of a `$ref`'s target (queued for normalizing)."""
        at = self._at(ptr)
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"{at}.$ref: only references inside the schema ('#/...' or '#anchor') are supported,"
                               f" not {str(ref)[:80]!r}")  # fmt: skip
        frag = ref[1:]
        if frag and not frag.startswith("/"):
            if frag not in self.anchors:
                raise GrammarError(f"{at}.$ref: no $anchor named {frag[:80]!r} in the schema")
            tokens = self.anchors[frag]
        else:
            tokens = pointer_tokens(frag)
        node: Any = self.root
        for tok in tokens:
            if isinstance(node, Mapping) and tok in node:
                node = node[tok]
            elif isinstance(node, list) and tok.isdigit() and int(tok) < len(node):
                node = node[int(tok)]
            else:
                raise GrammarError(f"{at}.$ref: {ref[:80]!r} points at nothing in the schema")
        target = "".join(f"/{_escape(t)}" for t in tokens)
        if target not in self.names:
            self.names[target] = f"r{len(self.names)}"
            self.todo.append((target, node))
        return self.names[target]

    def _schema(self, node: Any, ptr: str) -> Any:
        if isinstance(node, bool):
            return node
        at = self._at(ptr)
        if not isinstance(node, Mapping):
            raise GrammarError(f"{at}: a schema must be an object or a boolean")
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in REFUSED:
                if key == "uniqueItems" and value is False:
                    continue  # says nothing
                raise GrammarError(f"{at}: {key!r} cannot be enforced by the grammar ({REFUSED[key]})")
            if key in ANNOTATIONS:
                if key == "$id" and ptr:
                    raise GrammarError(f"{at}: a nested $id (a second schema resource) is not supported")
                continue
            if key not in ENFORCED:
                raise GrammarError(f"{at}: {key!r} is not a JSON-Schema keyword the grammar enforces"
                                   " (docs/serving.md lists them)")  # fmt: skip
            sub = f"{ptr}/{_escape(key)}"
            if key == "$ref":
                out[key] = f"#/$defs/{self._ref(value, ptr)}"
            elif key in ("$defs", "definitions"):
                continue  # targets are copied into the flat $defs once referenced
            elif key in _SCHEMA_MAPS:
                if not isinstance(value, Mapping):
                    raise GrammarError(f"{at}.{key}: must be an object of schemas")
                out[key] = {k: self._schema(v, f"{sub}/{_escape(k)}") for k, v in value.items()}
            elif key in _SCHEMA_LISTS:
                if not isinstance(value, list) or (key != "prefixItems" and not value):
                    raise GrammarError(f"{at}.{key}: must be a non-empty list of schemas")
                out[key] = [self._schema(v, f"{sub}/{i}") for i, v in enumerate(value)]
            elif key in _SCHEMA_ONE:
                out[key] = self._schema(value, sub)
            elif key == "items":
                out[key] = ([self._schema(v, f"{sub}/{i}") for i, v in enumerate(value)]
                            if isinstance(value, list) else self._schema(value, sub))  # fmt: skip
            elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
                raise GrammarError(f"{at}: {key!r} must be the bound itself, a number (the draft-4 boolean form"
                                   " is not supported)")  # fmt: skip
            else:
                out[key] = value
        if out.get("required") is not None and not (
            isinstance(out["required"], list) and all(isinstance(r, str) for r in out["required"])
        ):
            raise GrammarError(f"{at}.required: must be a list of property names")
        return out


def _escape(token: str) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")


# ---- finite values ------------------------------------------------------------------------------
def _check_finite(doc: Mapping[str, Any], pointers: dict[str, str], where: str) -> None:
    """Refuse `doc` (normalized: every $ref is `#/$defs/<name>`) unless its root and every
    referenced target have a finite value (a literal `false` target is a deliberate "none")."""
    defs = doc.get("$defs", {})
    productive: set[str] = set()
    changed = True
    while changed:  # least fixed point: each pass adds the targets whose value needs only known ones
        changed = False
        for name, node in defs.items():
            if name not in productive and _finite(node, productive):
                productive.add(name)
                changed = True
    for name, node in defs.items():
        if name not in productive and node is not False:
            ptr = pointers.get(name, "")
            at = f"{where}{ptr.replace('/', '.')}" if ptr else where
            raise GrammarError(f"{at}: this schema has no finite value (it needs itself: a $ref cycle, or a"
                               " required property, item or alternative that can only be written by repeating"
                               " it without end); give it a way out")  # fmt: skip
    if not _finite(doc, productive):
        raise GrammarError(f"{where}: this schema has no finite value (every branch needs a part that has none);"
                           " give it a way out")  # fmt: skip


def _finite(node: Any, productive: set[str]) -> bool:
    """Whether `node` has a finite value given the `$defs` names known to have one (an
    over-approximation beyond references: conflicting bounds are llguidance's to refuse)."""
    if isinstance(node, bool):
        return node
    ref = node.get("$ref")
    if ref is not None and ref.rsplit("/", 1)[-1] not in productive:
        return False
    if "enum" in node or "const" in node:
        return True  # a listed value is finite (whether it fits the types, llguidance checks)
    if not all(_finite(s, productive) for s in node.get("allOf", ())):
        return False
    if "anyOf" in node and not any(_finite(s, productive) for s in node["anyOf"]):
        return False
    types = node.get("type", _TYPES)
    types = [types] if isinstance(types, str) else types
    return any(_type_finite(t, node, productive) for t in types)


def _type_finite(t: str, node: Mapping[str, Any], productive: set[str]) -> bool:
    if t == "object":
        props = node.get("properties", {})
        for key in node.get("required", ()):
            if not _finite(_property_schema(node, key, props), productive):
                return False
        return True
    if t == "array":
        n = node.get("minItems", 0)
        prefix = node.get("prefixItems")
        items = node.get("items", True)
        if isinstance(items, list):  # draft 7's tuple form
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix or []
        need = [prefix[i] if i < len(prefix) else items for i in range(n if isinstance(n, int) else 0)]
        return all(_finite(s, productive) for s in need)
    return True


def _property_schema(node: Mapping[str, Any], key: str, props: Mapping[str, Any]) -> Any:
    if key in props:
        return props[key]
    for pattern, schema in node.get("patternProperties", {}).items():
        try:
            if re.search(pattern, key):
                return schema
        except re.error:
            continue
    return node.get("additionalProperties", True)

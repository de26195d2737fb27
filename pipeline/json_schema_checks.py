"""What a JSON schema must have before it is compiled into a grammar: a finite value.

A schema whose required properties lead back to itself ({"$ref": "#"} under `required`, a linked
list whose `next` is required) has no finite instance; compiled, the grammar forces `{"next": {"next":
...` until the parser gives up, so the output would stop after "{". Such a schema is refused.

A finite instance exists iff one exists whose derivation never passes through the same `$ref` twice
on a root-to-leaf path (replace the outer occurrence by the inner one's subtree: still an instance,
shallower). So the search below cuts a path at a repeated `$ref`, and is exact for the keywords it
reads: $ref, allOf (every part), anyOf / oneOf (some branch), type, required + properties /
additionalProperties, minItems + items / prefixItems, const / enum (always finite), false.
Constraints that contradict each other in other ways are left to the grammar compiler.
"""

from __future__ import annotations

_BUDGET = 20_000     # schema nodes visited at most; a schema beyond it is left to the compiler


def infinite_ref(schema) -> str | None:
    """The `$ref` of `schema` that every value must repeat without end (e.g. "#/$defs/node"), or
    None when a finite value may exist."""
    walk = _Walk(schema)
    if walk.finite(schema, ()):
        return None
    return walk.culprit if not walk.exhausted else None


class _Walk:
    def __init__(self, root):
        self.root, self.visits, self.culprit, self.exhausted = root, 0, None, False

    def finite(self, s, path: tuple[str, ...]) -> bool:
        self.visits += 1
        if self.visits > _BUDGET:
            self.exhausted = True
            return True
        if s is False:
            return False
        if not isinstance(s, dict):
            return True                 # true, or not a schema (the compiler says so)
        if "const" in s or "enum" in s:
            return True
        ref = s.get("$ref")
        if isinstance(ref, str):
            if ref in path:
                self.culprit = self.culprit or ref
                return False
            target = self._resolve(ref)
            if target is not None and not self.finite(target, (*path, ref)):
                return False
        if not all(self.finite(part, path) for part in s.get("allOf") or ()):
            return False
        for key in ("anyOf", "oneOf"):
            if s.get(key) and not any(self.finite(part, path) for part in s[key]):
                return False
        types = s.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is not None and any(t not in ("object", "array") for t in types):
            return True                 # a scalar type is allowed: a finite value
        shaped = types or [t for t, keys in (("object", ("required", "properties")), ("array", ("items",
                           "prefixItems", "minItems"))) if any(k in s for k in keys)]
        return not shaped or any(self._finite_shape(s, t, path) for t in shaped)

    def _finite_shape(self, s: dict, kind: str, path: tuple[str, ...]) -> bool:
        if kind == "object":
            props, extra = s.get("properties") or {}, s.get("additionalProperties", True)
            return all(self.finite(props.get(name, extra), path) for name in s.get("required") or ()
                       if isinstance(name, str))
        least = s.get("minItems", 0) if isinstance(s.get("minItems"), int) else 0
        prefix = s.get("prefixItems") or []
        needed = prefix[:least] + [s.get("items", True)] * max(0, least - len(prefix))
        return all(self.finite(item, path) for item in needed)

    def _resolve(self, ref: str):
        """A local reference ('#', '#/$defs/x', '#/definitions/x', any JSON pointer) -> its schema."""
        if not ref.startswith("#"):
            return None                 # remote: the compiler refuses it
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

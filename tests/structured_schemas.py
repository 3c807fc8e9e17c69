"""JSON schemas for the structured-output tests: nested objects, bounded arrays, enums, anyOf, $ref, string
formats and patterns, required and optional properties. Strings and arrays are bounded so that even a
random model's samples close their objects well within the tests' max_tokens."""

S = {"type": "string", "maxLength": 6}

SCHEMAS = [
    # flat objects
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}}, "required": ["ok", "n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x"]},
    {"type": "object", "properties": {"a": S, "b": S}, "required": ["a"]},  # b optional
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": []},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 100, "maximum": 999}}, "required": ["id"],
     "additionalProperties": False},
    # enums and consts
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "v": {"type": "integer"}}, "required": ["kind", "v"]},
    {"enum": ["alpha", "beta", 3, None, True]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "tag": {"enum": ["a", "b"]}},
     "required": ["level", "tag"]},
    # nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": S, "id": {"type": "integer"}},
                                               "required": ["name", "id"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}, "label": S},
     "required": ["point"]},
    # bounded arrays
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 2}}, "required": ["tags"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}, "required": ["points"]},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}], "items": False},
    # anyOf / oneOf
    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, S, {"type": "null"}]}}, "required": ["v"]},
    {"anyOf": [{"type": "object", "properties": {"cat": {"const": True}}, "required": ["cat"]},
               {"type": "object", "properties": {"dog": {"type": "integer"}}, "required": ["dog"]}]},
    # $ref / $defs
    {"$defs": {"P": {"type": "object", "properties": {"n": S}, "required": ["n"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/P"}, "b": {"$ref": "#/$defs/P"}}, "required": ["a", "b"]},
    {"definitions": {"Id": {"type": "integer", "minimum": 0, "maximum": 50}},
     "type": "array", "items": {"$ref": "#/definitions/Id"}, "maxItems": 3},
    # string formats and patterns
    # (xgrammar 0.2.9's "date", "time" and "ipv4" formats are approximations, e.g. 11-31 is a date to it, so
    # only formats it generates exactly are here.)
    {"type": "object", "properties": {"d": {"type": "string", "pattern": "^20[0-9]{2}-0[1-9]-[12][0-9]$"}},
     "required": ["d"]},
    {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}, "required": ["hex"]},
    {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"}}, "required": ["u"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["zip", "s"]},
    {"type": "string", "pattern": "^(yes|no)$"},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
     "required": ["word"]},
    # mixed
    {"type": "object", "properties": {"name": S, "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                        "maximum": 9}, "maxItems": 3},
                                      "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"]}}, "required": ["name", "scores", "meta"]},
]

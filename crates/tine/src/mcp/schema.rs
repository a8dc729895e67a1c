//! Tool schemas in standard JSON Schema (draft 2020-12) only.
//!
//! schemars writes Rust's integer and float widths as `format` values
//! ("uint8", "uint32", "int64", "double", ...) that JSON Schema does not
//! define (draft 2020-12 Validation §7.3 lists the standard formats);
//! strict validators such as Ajv, used by the official TypeScript SDK,
//! warn about each (`unknown format "uint8" ignored in schema`). [`standardize`]
//! rewrites every tool's input and output schema once: a width format
//! becomes the `minimum`/`maximum` it implies where a JSON number holds
//! it exactly, and the format is removed.

use serde_json::{Map, Value};

/// The formats JSON Schema draft 2020-12 defines (Validation §7.3).
pub const STANDARD_FORMATS: &[&str] = &[
    "date-time",
    "date",
    "time",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
];

/// The keywords of JSON Schema draft 2020-12 (Core §8-10, Validation
/// §6-9), annotations included.
#[cfg(test)]
pub const STANDARD_KEYWORDS: &[&str] = &[
    "$schema",
    "$id",
    "$ref",
    "$defs",
    "$comment",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$vocabulary",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "propertyNames",
    "unevaluatedProperties",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "items",
    "prefixItems",
    "contains",
    "minContains",
    "maxContains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "unevaluatedItems",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "if",
    "then",
    "else",
];

/// Keywords whose value maps names to subschemas.
const SCHEMA_MAPS: &[&str] = &["properties", "$defs", "patternProperties", "dependentSchemas"];
/// Keywords whose value is a subschema.
const SCHEMA_VALUES: &[&str] = &[
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "items",
    "contains",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
    "contentSchema",
];
/// Keywords whose value is a list of subschemas.
const SCHEMA_LISTS: &[&str] = &["prefixItems", "anyOf", "oneOf", "allOf"];

/// The range an integer width format implies, if a JSON number (an IEEE
/// double, exact to 2^53) holds both ends exactly.
fn range(format: &str) -> Option<(i64, i64)> {
    Some(match format {
        "uint8" => (0, u8::MAX.into()),
        "uint16" => (0, u16::MAX.into()),
        "uint32" | "uint" => (0, u32::MAX.into()),
        "int8" => (i8::MIN.into(), i8::MAX.into()),
        "int16" => (i16::MIN.into(), i16::MAX.into()),
        "int32" | "int" => (i32::MIN.into(), i32::MAX.into()),
        _ => return None,
    })
}

/// Rewrites `schema` (a schema object, with every subschema) to standard
/// formats: a non-standard `format` is removed, an integer width's range
/// kept as `minimum`/`maximum` (a tighter bound already there stays).
pub fn standardize(schema: &mut Map<String, Value>) {
    if let Some(Value::String(f)) = schema.get("format") {
        if !STANDARD_FORMATS.contains(&f.as_str()) {
            if let Some((lo, hi)) = range(f) {
                tighten(schema, "minimum", lo, |old, new| old >= new);
                tighten(schema, "maximum", hi, |old, new| old <= new);
            }
            schema.remove("format");
        }
    }
    for_each_subschema(schema, &mut |s| standardize(s));
}

/// Sets `schema[key] = bound` unless a bound there already `keeps`.
fn tighten(schema: &mut Map<String, Value>, key: &str, bound: i64, keeps: impl Fn(f64, f64) -> bool) {
    let old = schema.get(key).and_then(Value::as_f64);
    if !old.is_some_and(|o| keeps(o, bound as f64)) {
        schema.insert(key.into(), bound.into());
    }
}

/// Puts each local reference's target (`{"$ref": "#/$defs/NAME"}`) in its
/// place, the referring schema's own keywords winning, and drops `$defs`:
/// strict-schema converters refuse a `$ref` they did not resolve (the
/// OpenAI Agents SDK's `MCPUtil.to_function_tool`, whose strict mode then
/// falls back to a loose schema). A reference within its own expansion
/// (a recursive type) is left as it is.
pub fn inline_refs(schema: &mut Map<String, Value>) {
    let Some(Value::Object(defs)) = schema.remove("$defs") else { return };
    fn expand(s: &mut Map<String, Value>, defs: &Map<String, Value>, seen: &mut Vec<String>) {
        if let Some(Value::String(r)) = s.get("$ref").cloned() {
            let name = r.strip_prefix("#/$defs/").unwrap_or_default().to_string();
            if let (Some(Value::Object(target)), false) = (defs.get(&name), seen.contains(&name)) {
                s.remove("$ref");
                for (k, v) in target {
                    s.entry(k.clone()).or_insert_with(|| v.clone());
                }
                seen.push(name);
                expand(s, defs, seen);
                seen.pop();
                return;
            }
        }
        for_each_subschema(s, &mut |sub| expand(sub, defs, seen));
    }
    expand(schema, &defs, &mut Vec::new());
}

/// Calls `f` on each direct subschema of `schema` that is an object.
pub fn for_each_subschema(schema: &mut Map<String, Value>, f: &mut impl FnMut(&mut Map<String, Value>)) {
    for (k, v) in schema.iter_mut() {
        let k = k.as_str();
        if SCHEMA_MAPS.contains(&k) {
            if let Value::Object(m) = v {
                m.values_mut().filter_map(Value::as_object_mut).for_each(&mut *f);
            }
        } else if SCHEMA_VALUES.contains(&k) {
            if let Value::Object(m) = v {
                f(m);
            }
        } else if SCHEMA_LISTS.contains(&k) {
            if let Value::Array(a) = v {
                a.iter_mut().filter_map(Value::as_object_mut).for_each(&mut *f);
            }
        }
    }
}

/// What in `schema` is not standard JSON Schema: unknown keywords and
/// formats, each with its JSON pointer (the tests' check).
#[cfg(test)]
pub fn nonstandard(schema: &Map<String, Value>, at: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (k, v) in schema {
        if !STANDARD_KEYWORDS.contains(&k.as_str()) {
            found.push(format!("{at}: keyword {k:?}"));
        }
        if k == "format" && !v.as_str().is_some_and(|f| STANDARD_FORMATS.contains(&f)) {
            found.push(format!("{at}: format {v}"));
        }
        let sub = |s: &Value, path: String, found: &mut Vec<String>| {
            if let Some(m) = s.as_object() {
                found.extend(nonstandard(m, &path));
            }
        };
        if SCHEMA_MAPS.contains(&k.as_str()) {
            for (name, s) in v.as_object().into_iter().flatten() {
                sub(s, format!("{at}/{k}/{name}"), &mut found);
            }
        } else if SCHEMA_VALUES.contains(&k.as_str()) {
            sub(v, format!("{at}/{k}"), &mut found);
        } else if SCHEMA_LISTS.contains(&k.as_str()) {
            for (i, s) in v.as_array().into_iter().flatten().enumerate() {
                sub(s, format!("{at}/{k}/{i}"), &mut found);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn width_formats_become_ranges() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "a": {"type": "integer", "format": "uint8", "minimum": 0},
                "b": {"type": ["integer", "null"], "format": "uint64", "minimum": 0},
                "c": {"type": "number", "format": "double"},
                "d": {"type": "integer", "format": "int32", "maximum": 10},
                "e": {"type": "string", "format": "date-time"},
            },
            "$defs": {"X": {"anyOf": [{"format": "uint32"}, {"type": "null"}]}},
        })
        .as_object()
        .unwrap()
        .clone();
        standardize(&mut s);
        let p = &s["properties"];
        assert_eq!(p["a"], json!({"type": "integer", "minimum": 0, "maximum": 255}));
        assert_eq!(p["b"], json!({"type": ["integer", "null"], "minimum": 0}));
        assert_eq!(p["c"], json!({"type": "number"}));
        assert_eq!(p["d"], json!({"type": "integer", "minimum": i32::MIN, "maximum": 10}));
        assert_eq!(p["e"], json!({"type": "string", "format": "date-time"}));
        assert_eq!(s["$defs"]["X"]["anyOf"][0], json!({"minimum": 0, "maximum": u32::MAX}));
        assert!(nonstandard(&s, "#").is_empty(), "{:?}", nonstandard(&s, "#"));
    }

    #[test]
    fn nonstandard_names_what_and_where() {
        let s = json!({"properties": {"n": {"format": "uint8", "nullable": true}}}).as_object().unwrap().clone();
        assert_eq!(
            nonstandard(&s, "#"),
            vec!["#/properties/n: format \"uint8\"".to_string(), "#/properties/n: keyword \"nullable\"".to_string()]
        );
    }
}

//! Reading a Hugging Face `config.json`'s optional fields the one way every family does: a
//! field that is absent or null takes its default; present, it must be of its kind. And its
//! RoPE object, under its current or its older names ([`rope`], [`rope_type`]).

use serde_json::Value;

/// The field `name` of `v`, unless absent or null.
pub fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

/// The positive integer field `name` of `v` (`default` when absent or null); `Err` naming it
/// when it is no positive integer.
pub fn count(v: &Value, name: &str, default: usize) -> Result<usize, String> {
    match field(v, name) {
        None => Ok(default),
        Some(x) => x
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| format!("field `{name}`: not a positive integer")),
    }
}

/// Where a config keeps its RoPE object: `rope_parameters`, or the older `rope_scaling`.
pub const ROPE_FIELDS: [&str; 2] = ["rope_parameters", "rope_scaling"];

/// Where a RoPE object names its type: `rope_type`, or the older `type`.
pub const ROPE_TYPE_FIELDS: [&str; 2] = ["rope_type", "type"];

/// The config `v`'s RoPE object, if it has one ([`ROPE_FIELDS`]).
pub fn rope(v: &Value) -> Option<&Value> {
    ROPE_FIELDS.iter().find_map(|f| field(v, f))
}

/// A RoPE object's type ([`ROPE_TYPE_FIELDS`]: a `rope_scaling` of `"type": "linear"` is no
/// default RoPE).
pub fn rope_type(rope: &Value) -> Option<&str> {
    ROPE_TYPE_FIELDS
        .iter()
        .find_map(|f| rope.get(*f).and_then(Value::as_str))
}

//! Reading a Hugging Face `config.json`'s optional fields the one way every family does: a
//! field that is absent or null takes its default; present, it must be of its kind.

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

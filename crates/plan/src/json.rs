//! Reading a description (model, cluster) from JSON so that every bad value gets one error
//! naming its field: [`Fields`] takes the object apart field by field — missing, wrong type,
//! out of range, unknown — instead of serde's positional messages.

use crate::error::PlanError;
use serde_json::{Map, Value};

/// The fields of one JSON object, taken one at a time; [`Fields::finish`] rejects the ones
/// nobody asked for (a misspelt field is an error, not a silent default).
pub struct Fields {
    what: String,
    map: Map<String, Value>,
}

impl Fields {
    /// Parses `text` as one JSON object; `what` names it in errors (`model gpt.json`).
    pub fn parse(what: &str, text: &str) -> Result<Self, PlanError> {
        let value: Value = serde_json::from_str(text).map_err(|e| PlanError::File {
            what: what.to_string(),
            reason: format!("not valid JSON: {e}"),
        })?;
        match value {
            Value::Object(map) => Ok(Self {
                what: what.to_string(),
                map,
            }),
            other => Err(PlanError::File {
                what: what.to_string(),
                reason: format!("expected a JSON object, found {}", kind(&other)),
            }),
        }
    }

    /// What the description is called in errors.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// An error about `field`.
    pub fn error(&self, field: &str, reason: impl Into<String>) -> PlanError {
        PlanError::field(&self.what, field, reason)
    }

    /// Takes `field` out, if present (a JSON `null` counts as absent).
    pub fn take(&mut self, field: &str) -> Option<Value> {
        self.map.remove(field).filter(|v| !v.is_null())
    }

    /// A positive integer, required.
    pub fn count(&mut self, field: &str) -> Result<usize, PlanError> {
        let v = self
            .take(field)
            .ok_or_else(|| self.error(field, "missing (a positive integer)"))?;
        self.positive(field, &v)
    }

    /// A positive integer, or `None` when absent.
    pub fn count_opt(&mut self, field: &str) -> Result<Option<usize>, PlanError> {
        match self.take(field) {
            None => Ok(None),
            Some(v) => self.positive(field, &v).map(Some),
        }
    }

    fn positive(&self, field: &str, v: &Value) -> Result<usize, PlanError> {
        match v.as_u64() {
            Some(0) => Err(self.error(field, "must be at least 1, got 0")),
            Some(n) => Ok(n as usize),
            None => Err(self.error(
                field,
                format!("expected a positive integer, found {}", show(v)),
            )),
        }
    }

    /// A positive number, or `None` when absent.
    pub fn number_opt(&mut self, field: &str) -> Result<Option<f64>, PlanError> {
        match self.take(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x > 0.0 && x.is_finite() => Ok(Some(x)),
                _ => Err(self.error(
                    field,
                    format!("expected a positive number, found {}", show(&v)),
                )),
            },
        }
    }

    /// A fraction in `[0, 1]`, or `None` when absent.
    pub fn fraction_opt(&mut self, field: &str) -> Result<Option<f64>, PlanError> {
        match self.take(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if (0.0..=1.0).contains(&x) => Ok(Some(x)),
                _ => Err(self.error(
                    field,
                    format!("expected a fraction between 0 and 1, found {}", show(&v)),
                )),
            },
        }
    }

    /// A boolean, or `None` when absent.
    pub fn bool_opt(&mut self, field: &str) -> Result<Option<bool>, PlanError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => {
                Err(self.error(field, format!("expected true or false, found {}", show(&v))))
            }
        }
    }

    /// A string, or `None` when absent.
    pub fn string_opt(&mut self, field: &str) -> Result<Option<String>, PlanError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.error(field, format!("expected a string, found {}", show(&v)))),
        }
    }

    /// A byte count: an integer or a string such as `"80GiB"`; `None` when absent.
    pub fn bytes_opt(&mut self, field: &str) -> Result<Option<usize>, PlanError> {
        match self.take(field) {
            None => Ok(None),
            Some(Value::String(s)) => crate::bytes::parse_bytes(&s)
                .map(Some)
                .map_err(|e| self.error(field, e)),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(self.error(
                    field,
                    format!(
                        "expected a byte count such as \"80GiB\", found {}",
                        show(&v)
                    ),
                )),
            },
        }
    }

    /// Rejects the fields left over (unknown ones), naming the first.
    pub fn finish(self, known: &[&str]) -> Result<(), PlanError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => Err(self.error(k, format!("unknown field (known: {})", known.join(", ")))),
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn show(v: &Value) -> String {
    match v {
        Value::String(_) | Value::Number(_) | Value::Bool(_) => format!("{} {v}", kind(v)),
        other => kind(other).to_string(),
    }
}

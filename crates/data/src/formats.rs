//! The documents of one data file, by its name: plain UTF-8 text (the whole file is one
//! document), JSON Lines (`*.jsonl`: one document per non-empty line, its `text` field — what
//! Hugging Face `datasets` writes with `to_json`) and, with the `parquet` feature, Parquet
//! (`*.parquet`: one document per row of its `text` column — what `datasets` writes with
//! `to_parquet` and what the Hub serves).

use crate::DataError;
use std::path::Path;

/// How a data file holds its documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Text,
    JsonLines,
    Parquet,
}

impl Format {
    /// The format of `path`, by its extension (case-insensitive; anything else is text).
    pub(crate) fn of(path: &Path) -> Self {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("jsonl") => Format::JsonLines,
            Some("parquet") => Format::Parquet,
            _ => Format::Text,
        }
    }
}

/// The field (JSON Lines) or column (Parquet) that holds a record's text.
pub(crate) const TEXT_FIELD: &str = "text";

/// Calls `f` on each document of `path`, in order. Errors name the file and, for a record
/// without text, its line or row.
pub(crate) fn for_each_document(
    path: &Path,
    mut f: impl FnMut(&str) -> Result<(), DataError>,
) -> Result<(), DataError> {
    match Format::of(path) {
        Format::Text => f(&read_text(path)?),
        Format::JsonLines => {
            let text = read_text(path)?;
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                f(&json_text(line).map_err(|why| bad_record(path, "line", i + 1, why))?)?;
            }
            Ok(())
        }
        Format::Parquet => parquet_documents(path, f),
    }
}

/// The whole of `path` as UTF-8.
fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, "reading", e))?;
    String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// The `text` string of one JSON Lines record, or what is wrong with it.
fn json_text(line: &str) -> Result<String, String> {
    let record: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    match record.get(TEXT_FIELD) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("`{TEXT_FIELD}` is not a string: {other}")),
        None => Err(format!("no `{TEXT_FIELD}` field")),
    }
}

fn bad_record(path: &Path, unit: &'static str, at: usize, why: String) -> DataError {
    DataError::BadRecord {
        path: path.to_path_buf(),
        unit,
        at,
        why,
    }
}

/// Each row's `text` column of a Parquet file.
#[cfg(feature = "parquet")]
fn parquet_documents(
    path: &Path,
    mut f: impl FnMut(&str) -> Result<(), DataError>,
) -> Result<(), DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, "reading", e))?;
    let bad = |at: usize, why: String| bad_record(path, "row", at, why);
    let reader = SerializedFileReader::new(file).map_err(|e| bad(0, e.to_string()))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let column = schema
        .columns()
        .iter()
        .position(|c| c.name() == TEXT_FIELD)
        .ok_or_else(|| bad(0, format!("no `{TEXT_FIELD}` column")))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| bad(0, e.to_string()))?;
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| bad(i + 1, e.to_string()))?;
        let (_, value) = row
            .get_column_iter()
            .nth(column)
            .ok_or_else(|| bad(i + 1, format!("no `{TEXT_FIELD}` value")))?;
        match value {
            Field::Str(s) => f(s)?,
            other => {
                return Err(bad(
                    i + 1,
                    format!("`{TEXT_FIELD}` is not a string: {other}"),
                ));
            }
        }
    }
    Ok(())
}

/// Without the `parquet` feature: refused, saying how to build with it.
#[cfg(not(feature = "parquet"))]
fn parquet_documents(
    path: &Path,
    _: impl FnMut(&str) -> Result<(), DataError>,
) -> Result<(), DataError> {
    Err(bad_record(
        path,
        "row",
        0,
        "Parquet needs a build with the `parquet` feature (`--features parquet`), or convert \
         it to JSON Lines"
            .into(),
    ))
}

//! JSON Lines and Parquet data files (`fixtures/make_records.py`, written as Hugging Face
//! `datasets` writes them): each record's `text` a document followed by end-of-text; a record
//! without text refused naming its line.

use bonfire_data::{DataError, TextCorpus};
use std::fs;

use crate::{fixture, tokenizer};

/// The fixture's three documents (as `make_records.py` has them).
const TEXTS: [&str; 3] = [
    "We hold these truths to be self-evident.",
    "Four score and seven years ago — naïve.",
    "Two lines:\nthe second one.",
];

/// The tokens of the three documents, each followed by end-of-text.
fn want() -> Vec<u32> {
    let t = tokenizer();
    let eot = t.eot_id().unwrap();
    TEXTS
        .iter()
        .flat_map(|text| {
            let mut ids = t.encode(text).unwrap();
            ids.push(eot);
            ids
        })
        .collect()
}

/// `name` of the fixtures copied into a fresh directory (the cache is written beside it).
fn copy(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    fs::copy(fixture(name), &path).unwrap();
    (dir, path)
}

#[test]
fn a_json_lines_file_is_one_document_per_record() {
    let (_dir, path) = copy("records.jsonl");
    let corpus = TextCorpus::open(&path, &tokenizer()).unwrap();
    assert_eq!(corpus.tokens().to_vec(), want());
}

#[test]
fn a_record_without_text_is_refused_naming_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    fs::write(
        &path,
        "{\"text\": \"fine\"}\n\n{\"content\": \"no text\"}\n",
    )
    .unwrap();
    let err = TextCorpus::open(&path, &tokenizer()).unwrap_err();
    assert!(matches!(err, DataError::BadRecord { at: 3, .. }), "{err}");
    assert!(err.to_string().contains("line 3: no `text` field"), "{err}");
    fs::write(&path, "{\"text\": 7}\n").unwrap();
    let err = TextCorpus::open(&path, &tokenizer()).unwrap_err();
    assert!(
        err.to_string().contains("line 1: `text` is not a string"),
        "{err}"
    );
    fs::write(&path, "not json\n").unwrap();
    let err = TextCorpus::open(&path, &tokenizer()).unwrap_err();
    assert!(err.to_string().contains("line 1: not JSON"), "{err}");
}

#[cfg(feature = "parquet")]
#[test]
fn a_parquet_file_is_one_document_per_row() {
    let (_dir, path) = copy("records.parquet");
    let corpus = TextCorpus::open(&path, &tokenizer()).unwrap();
    assert_eq!(corpus.tokens().to_vec(), want());
}

#[cfg(not(feature = "parquet"))]
#[test]
fn parquet_without_the_feature_says_how_to_build_it() {
    let (_dir, path) = copy("records.parquet");
    let err = TextCorpus::open(&path, &tokenizer()).unwrap_err();
    assert!(err.to_string().contains("`parquet` feature"), "{err}");
}

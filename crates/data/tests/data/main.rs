//! bonfire-data's tests: one binary, a module per source file.

mod packed;
mod records;
mod text;
mod tokenizer;
mod tokens;

use std::path::{Path, PathBuf};

use bonfire_data::Tokenizer;

/// The fixture written by `tests/fixtures/make_tokenizer.py`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The fixture's byte-level BPE (400 tokens, `<|endoftext|>` = 0).
pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(fixture("tokenizer.json")).expect("the fixture tokenizer loads")
}

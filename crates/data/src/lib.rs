//! Your own text and token files, into packed training sequences for a language model —
//! what nanoGPT, llm.c and torchtitan users expect to hand a trainer.
//!
//! - [`Tokenizer`]: a Hugging Face `tokenizer.json`, read offline (pure Rust, no download),
//!   with the end-of-text token that separates documents.
//! - [`TokenFile`]: a token file as nanoGPT writes it (`u16` ids, `u32` above 65536 tokens)
//!   or as llm.c does (its 1024-byte header), memory-mapped and checked once against the
//!   vocabulary.
//! - [`TextCorpus`]: a UTF-8 text file or a directory of them, each file a document,
//!   tokenized once with an end-of-text token after each document, and cached beside the
//!   data as a token file that later runs reuse while the tokenizer and documents are
//!   unchanged.
//! - [`PackedSequences`]: the tokens cut into non-overlapping sequences (inputs and targets
//!   shifted by one), in a seeded shuffle per epoch, read by step and by row so that a
//!   resumed run continues exactly and each data-parallel replica reads only its rows.
//! - [`generated`]: a small corpus generated in code with its character tokenizer and
//!   seeded windows — the zero-setup data of the main job and the parity tests.
//!
//! Every failure is a [`DataError`] that says what is wrong and where.
//!
//! ```
//! use bonfire_data::{PackedSequences, TextCorpus, Tokenizer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let tokenizer = Tokenizer::from_file(concat!(
//!     env!("CARGO_MANIFEST_DIR"),
//!     "/tests/fixtures/tokenizer.json"
//! ))?;
//! let dir = tempfile::tempdir()?;
//! std::fs::write(dir.path().join("a.txt"), "We hold these truths to be self-evident.")?;
//! std::fs::write(dir.path().join("b.txt"), "Four score and seven years ago.")?;
//!
//! // Tokenized once: a.txt, <|endoftext|>, b.txt, <|endoftext|>; cached in the directory.
//! let corpus = TextCorpus::open(dir.path(), &tokenizer)?;
//! assert_eq!(corpus.tokens().get(corpus.tokens().len() - 1), tokenizer.eot_id()?);
//!
//! let data = PackedSequences::new(corpus.into_tokens(), 8, 42)?;
//! // Step 3 of a global batch of 4, the rows of replica 1 of 2.
//! let (inputs, targets) = data.batch(3, 4, 2..4);
//! assert_eq!((inputs.len(), targets.len()), (2 * 8, 2 * 8));
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_code)]

mod error;
mod formats;
pub mod generated;
mod hash;
mod packed;
mod text;
mod tokenizer;
mod tokens;

use std::path::Path;

pub use error::DataError;
pub use packed::PackedSequences;
pub use text::TextCorpus;
pub use tokenizer::{EOT_CANDIDATES, Tokenizer};
pub use tokens::{
    LLMC_HEADER_BYTES, LLMC_MAGIC, TokenFile, TokenFormat, TokenWidth, TokenWriter, Tokens,
    write_tokens,
};

/// The tokens of `path`, whatever it holds: a file named `*.bin` is a token file (nanoGPT's
/// or llm.c's, checked against `tokenizer`'s vocabulary); any other file, or a directory, is
/// text, tokenized with `tokenizer` and cached (see [`TextCorpus`]).
pub fn load_tokens(path: impl AsRef<Path>, tokenizer: &Tokenizer) -> Result<TokenFile, DataError> {
    let path = path.as_ref();
    if path.extension().is_some_and(|e| e == "bin") && !path.is_dir() {
        TokenFile::open(path, tokenizer.vocab_size())
    } else {
        TextCorpus::open(path, tokenizer).map(TextCorpus::into_tokens)
    }
}

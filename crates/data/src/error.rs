//! The one error type of the crate: each variant says what is wrong and where.

use std::io;
use std::path::{Path, PathBuf};

/// Everything that can go wrong turning files into training sequences.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A path that should exist does not.
    #[error("{}: no such file or directory", path.display())]
    Missing {
        /// The path asked for.
        path: PathBuf,
    },

    /// An I/O operation on `path` failed (other than the path being missing).
    #[error("{}: {action}: {source}", path.display())]
    Io {
        /// The file or directory it failed on.
        path: PathBuf,
        /// What was being done (`"reading"`, `"memory-mapping"`, …).
        action: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },

    /// A token file holds an id that the tokenizer's vocabulary does not have.
    #[error(
        "{}: token {token} at position {position} is out of the vocabulary of {vocab_size} tokens",
        path.display()
    )]
    TokenOutOfVocab {
        /// The token file.
        path: PathBuf,
        /// The token's index in the file (0-based, in tokens, after any header).
        position: usize,
        /// The offending id.
        token: u32,
        /// The vocabulary size it was checked against.
        vocab_size: usize,
    },

    /// A token file whose length is not a whole number of tokens.
    #[error(
        "{}: {bytes} bytes of tokens is not a whole number of {width}-byte tokens",
        path.display()
    )]
    BadLength {
        /// The token file.
        path: PathBuf,
        /// The bytes after any header.
        bytes: u64,
        /// The bytes per token the file was read with.
        width: usize,
    },

    /// A token file that starts with llm.c's magic number but whose header is wrong: an
    /// unknown version, a truncated header, or a token count that does not match the file.
    #[error("{}: bad llm.c header: {reason}", path.display())]
    BadHeader {
        /// The token file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// Fewer tokens than one training sequence needs.
    #[error(
        "{tokens} tokens are too few for one sequence of length {seq_len}: \
         need at least {needed} (seq_len + 1, for the targets shifted by one)"
    )]
    TooShort {
        /// The tokens there are.
        tokens: usize,
        /// The sequence length asked for.
        seq_len: usize,
        /// The tokens one sequence needs.
        needed: usize,
    },

    /// A sequence length of zero.
    #[error("the sequence length must be at least 1, not 0")]
    ZeroSeqLen,

    /// `tokenizer.json` could not be parsed into a tokenizer.
    #[error("{}: cannot load the tokenizer: {reason}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// The `tokenizers` crate's message.
        reason: String,
    },

    /// The tokenizer failed to encode or decode.
    #[error("{}: tokenizer failed: {reason}", path.display())]
    Encode {
        /// The tokenizer file.
        path: PathBuf,
        /// The `tokenizers` crate's message.
        reason: String,
    },

    /// The tokenizer has none of the known end-of-text tokens, and none was named.
    #[error(
        "{}: the vocabulary has none of the end-of-text tokens {}; name the one it uses with \
         Tokenizer::with_eot",
        path.display(),
        candidates.join(", ")
    )]
    NoEndOfText {
        /// The tokenizer file.
        path: PathBuf,
        /// The tokens looked for, in order.
        candidates: Vec<&'static str>,
    },

    /// A token named (for example with `with_eot`) that the vocabulary does not have.
    #[error("{}: the vocabulary has no token {token:?}", path.display())]
    UnknownToken {
        /// The tokenizer file.
        path: PathBuf,
        /// The token asked for.
        token: String,
    },

    /// A text file that is not valid UTF-8.
    #[error(
        "{}: not UTF-8 text (the first invalid byte is at offset {offset})",
        path.display()
    )]
    NotUtf8 {
        /// The text file.
        path: PathBuf,
        /// The byte offset of the first invalid sequence.
        offset: usize,
    },

    /// A record of a JSON Lines or Parquet file without text (or a file that is not one).
    #[error("{}: {unit} {at}: {why}", path.display())]
    BadRecord {
        /// The data file.
        path: PathBuf,
        /// `line` (JSON Lines) or `row` (Parquet).
        unit: &'static str,
        /// The line or row, from 1 (0: the file as a whole).
        at: usize,
        /// What is wrong.
        why: String,
    },

    /// A directory of text without any document in it.
    #[error(
        "{}: no documents (the directory has no regular, non-hidden file)",
        path.display()
    )]
    NoDocuments {
        /// The directory.
        path: PathBuf,
    },
}

impl DataError {
    /// The error of an I/O failure on `path`: [`DataError::Missing`] when it is not found,
    /// [`DataError::Io`] otherwise.
    pub(crate) fn io(path: &Path, action: &'static str, source: io::Error) -> Self {
        if source.kind() == io::ErrorKind::NotFound {
            DataError::Missing {
                path: path.to_path_buf(),
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                action,
                source,
            }
        }
    }
}

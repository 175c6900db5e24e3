//! A Hugging Face `tokenizer.json`, read offline with the `tokenizers` crate.

use std::path::{Path, PathBuf};

use crate::DataError;
use crate::hash::Fnv64;

/// The end-of-text tokens looked for, in this order, when none is named with
/// [`Tokenizer::with_eot`]: GPT-2's, Llama 3's base, SentencePiece's (Llama 2, Mistral),
/// Gemma's, and Llama 3's instruct end of turn.
pub const EOT_CANDIDATES: [&str; 5] = [
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eot_id|>",
];

/// A tokenizer loaded from a Hugging Face `tokenizer.json` (as `save_pretrained` writes it),
/// with the end-of-text token that separates documents.
///
/// Encoding adds no special tokens (no BOS, no template): the ids are the text's alone.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    eot: Option<u32>,
    /// A hash of the file's bytes, for the text caches.
    fingerprint: u64,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("eot", &self.eot)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `path` (a `tokenizer.json`). Nothing is downloaded. The end-of-text token is the
    /// first of [`EOT_CANDIDATES`] in the vocabulary; [`Tokenizer::with_eot`] names another.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, "reading", e))?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        // One more than the largest id: the number of tokens when the ids are contiguous, as
        // they are in practice; never less, so that every id the tokenizer gives is in range.
        let largest = inner.get_vocab(true).into_values().max();
        let vocab_size = inner
            .get_vocab_size(true)
            .max(largest.map_or(0, |id| id as usize + 1));
        let eot = EOT_CANDIDATES.iter().find_map(|t| inner.token_to_id(t));
        let mut fingerprint = Fnv64::new();
        fingerprint.write(&bytes);
        Ok(Tokenizer {
            inner,
            path: path.to_path_buf(),
            vocab_size,
            eot,
            fingerprint: fingerprint.finish(),
        })
    }

    /// Names the end-of-text token (`"<|eot_id|>"`, say), instead of the first of
    /// [`EOT_CANDIDATES`]; an error if the vocabulary does not have it.
    pub fn with_eot(mut self, token: &str) -> Result<Self, DataError> {
        let id = self
            .inner
            .token_to_id(token)
            .ok_or_else(|| DataError::UnknownToken {
                path: self.path.clone(),
                token: token.to_string(),
            })?;
        self.eot = Some(id);
        Ok(self)
    }

    /// The ids of `text`, with no special tokens added. A special token written in the text
    /// (`<|endoftext|>`, say) is still one id, as Python's `tokenizers` gives it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| self.encode_error(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| self.encode_error(e))
    }

    /// The number of ids, added tokens included (one more than the largest id).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of the end-of-text token that ends each document; an error naming
    /// [`EOT_CANDIDATES`] if the vocabulary has none of them and none was named with
    /// [`Tokenizer::with_eot`].
    pub fn eot_id(&self) -> Result<u32, DataError> {
        self.eot.ok_or_else(|| DataError::NoEndOfText {
            path: self.path.clone(),
            candidates: EOT_CANDIDATES.to_vec(),
        })
    }

    /// The id of `token`, if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A hash of the tokenizer file's bytes (what the text caches key on).
    pub(crate) fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    fn encode_error(&self, e: tokenizers::Error) -> DataError {
        DataError::Encode {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }
}

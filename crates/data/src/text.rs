//! Text files, tokenized once and cached beside the data as a token file.
//!
//! A path is one data file, or a directory of them: every regular file directly in it
//! (subdirectories are not entered), sorted by name, hidden files (`.name`) skipped. A UTF-8
//! text file is one document, a JSON Lines file (`*.jsonl`) one per line's `text`, a Parquet
//! file (`*.parquet`, with the `parquet` feature) one per row's `text` (`formats.rs`); the
//! documents are tokenized in that order, each followed by the end-of-text token, and the ids
//! written to a cache:
//!
//! - for a file `dir/name`: `dir/.name.<hash>.tokens.bin`;
//! - for a directory `dir`: `dir/.<dir's name>.<hash>.tokens.bin`.
//!
//! The caches are hidden files, so a directory of text never takes one for a document.
//! `<hash>` (16 hex digits) covers the tokenizer file's bytes, the end-of-text id, and every
//! document's (canonical) path, length and modification time: a later run with the same tokenizer over
//! unchanged documents reads the cache instead of tokenizing again, and one where anything
//! changed writes a new cache (and deletes the stale ones of the same name). A cache is an
//! llm.c token file (its header's count catches a truncated one, which is then rebuilt),
//! written to a temporary name and renamed into place, so that a reader never sees half of
//! one.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use crate::hash::Fnv64;
use crate::tokens::{TokenFile, TokenFormat, TokenWidth, TokenWriter};
use crate::{DataError, Tokenizer};

/// Bumped when the cache's contents would change for the same inputs.
const CACHE_VERSION: &str = "bonfire-data text cache v1";
const CACHE_SUFFIX: &str = ".tokens.bin";

/// Text tokenized (or read back from its cache): the documents, the cache file and its ids.
#[derive(Debug)]
pub struct TextCorpus {
    documents: Vec<PathBuf>,
    cache: PathBuf,
    reused: bool,
    tokens: TokenFile,
}

impl TextCorpus {
    /// Tokenizes the text file or directory `path` with `tokenizer` (each document followed
    /// by [`Tokenizer::eot_id`]), or reads the cache of an earlier run over the same,
    /// unchanged documents. Errors name the path: a missing one, an empty directory, a file
    /// that is not UTF-8, a tokenizer without an end-of-text token, a cache that cannot be
    /// written beside the data.
    pub fn open(path: impl AsRef<Path>, tokenizer: &Tokenizer) -> Result<Self, DataError> {
        let path = path.as_ref();
        let eot = tokenizer.eot_id()?;
        let metadata = fs::metadata(path).map_err(|e| DataError::io(path, "reading", e))?;
        let (documents, cache_dir, name) = if metadata.is_dir() {
            let name = path
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "corpus".into());
            (list_documents(path)?, path.to_path_buf(), name)
        } else {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "corpus".into());
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            (vec![path.to_path_buf()], dir, name)
        };
        let width = TokenWidth::for_vocab(tokenizer.vocab_size());

        let mut hash = Fnv64::new();
        hash.write_field(CACHE_VERSION.as_bytes());
        hash.write(&tokenizer.fingerprint().to_le_bytes());
        hash.write(&eot.to_le_bytes());
        hash.write(&(width.bytes() as u64).to_le_bytes());
        for doc in &documents {
            let m = fs::metadata(doc).map_err(|e| DataError::io(doc, "reading", e))?;
            let modified = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            // The canonical path, so that `data/` and `./data` share a cache.
            let canonical = doc.canonicalize().unwrap_or_else(|_| doc.clone());
            hash.write_field(canonical.as_os_str().as_encoded_bytes());
            hash.write(&m.len().to_le_bytes());
            hash.write(&modified.to_le_bytes());
        }
        let prefix = format!(".{name}.");
        let cache = cache_dir.join(format!("{prefix}{:016x}{CACHE_SUFFIX}", hash.finish()));

        if cache.is_file() {
            // A cache that does not read back (truncated, say) is rebuilt.
            if let Ok(tokens) = TokenFile::open(&cache, tokenizer.vocab_size()) {
                return Ok(TextCorpus {
                    documents,
                    cache,
                    reused: true,
                    tokens,
                });
            }
        }
        build(&documents, tokenizer, eot, width, &cache)?;
        remove_stale(&cache_dir, &prefix, &cache);
        let tokens = TokenFile::open(&cache, tokenizer.vocab_size())?;
        Ok(TextCorpus {
            documents,
            cache,
            reused: false,
            tokens,
        })
    }

    /// The documents, in the order they were joined.
    pub fn documents(&self) -> &[PathBuf] {
        &self.documents
    }

    /// The cache file the ids are read from.
    pub fn cache_path(&self) -> &Path {
        &self.cache
    }

    /// Whether an existing cache was read (`false`: the text was tokenized by this call).
    pub fn reused_cache(&self) -> bool {
        self.reused
    }

    /// The ids: every document's, each followed by the end-of-text id.
    pub fn tokens(&self) -> &TokenFile {
        &self.tokens
    }

    /// The ids, owned.
    pub fn into_tokens(self) -> TokenFile {
        self.tokens
    }
}

/// The regular, non-hidden files directly in `dir`, sorted by name.
fn list_documents(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut documents = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, "listing", e))? {
        let entry = entry.map_err(|e| DataError::io(dir, "listing", e))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // `fs::metadata` follows symbolic links: a link to a file is a document.
        let m = fs::metadata(&path).map_err(|e| DataError::io(&path, "reading", e))?;
        if m.is_file() {
            documents.push(path);
        }
    }
    if documents.is_empty() {
        return Err(DataError::NoDocuments {
            path: dir.to_path_buf(),
        });
    }
    documents.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(documents)
}

/// Tokenizes `documents` into `cache`, through a temporary file renamed into place.
fn build(
    documents: &[PathBuf],
    tokenizer: &Tokenizer,
    eot: u32,
    width: TokenWidth,
    cache: &Path,
) -> Result<(), DataError> {
    // Unique among this process's threads and other processes building the same cache.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let temporary = cache.with_extension(format!(
        "tmp-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut writer = TokenWriter::create(&temporary, width, TokenFormat::LlmC)?;
        for doc in documents {
            crate::formats::for_each_document(doc, |text| {
                writer.push(&tokenizer.encode(text)?)?;
                writer.push(&[eot])
            })?;
        }
        writer.finish()?;
        fs::rename(&temporary, cache).map_err(|e| DataError::io(cache, "renaming into", e))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temporary);
    }
    written
}

/// Deletes the caches of the same name as `current` with another hash (best effort).
fn remove_stale(dir: &Path, prefix: &str, current: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_cache = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(CACHE_SUFFIX))
            .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()));
        if is_cache && entry.path() != current {
            let _ = fs::remove_file(entry.path());
        }
    }
}

use std::fs;
use std::path::Path;

use bonfire_data::{
    DataError, TextCorpus, TokenFile, TokenFormat, TokenWidth, load_tokens, write_tokens,
};

use crate::tokenizer;

const DOC_A: &str = "We hold these truths to be self-evident.\n";
const DOC_B: &str = "Four score and seven years ago — naïve.\n";

/// `dir` with a.txt and b.txt (written b first), a hidden file and a subdirectory.
fn corpus_dir(dir: &Path) {
    fs::write(dir.join("b.txt"), DOC_B).unwrap();
    fs::write(dir.join("a.txt"), DOC_A).unwrap();
    fs::write(dir.join(".notes"), [0xffu8, 0xfe]).unwrap(); // hidden: skipped (not UTF-8)
    fs::create_dir(dir.join("sub")).unwrap();
    fs::write(dir.join("sub/c.txt"), "not a document").unwrap();
}

fn caches(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tokens.bin"))
        .collect();
    v.sort();
    v
}

/// A directory is its regular, non-hidden files sorted by name, each followed by EOT.
#[test]
fn a_directory_is_its_documents_each_followed_by_eot() {
    let t = tokenizer();
    let eot = t.eot_id().unwrap();
    let dir = tempfile::tempdir().unwrap();
    corpus_dir(dir.path());

    let corpus = TextCorpus::open(dir.path(), &t).unwrap();
    assert_eq!(
        corpus.documents(),
        [dir.path().join("a.txt"), dir.path().join("b.txt")]
    );
    let mut want = t.encode(DOC_A).unwrap();
    want.push(eot);
    want.extend(t.encode(DOC_B).unwrap());
    want.push(eot);
    assert_eq!(corpus.tokens().to_vec(), want);
    assert_eq!(corpus.tokens().width(), TokenWidth::U16);

    // A single file: its tokens and EOT, cached beside it.
    let corpus = TextCorpus::open(dir.path().join("b.txt"), &t).unwrap();
    let mut want = t.encode(DOC_B).unwrap();
    want.push(eot);
    assert_eq!(corpus.tokens().to_vec(), want);
    assert_eq!(corpus.cache_path().parent(), Some(dir.path()));
    let name = corpus.cache_path().file_name().unwrap().to_string_lossy();
    assert!(
        name.starts_with(".b.txt.") && name.ends_with(".tokens.bin"),
        "{name}"
    );
}

/// The cache is written in the directory (hidden, so it is no document), read back by a
/// later run instead of tokenizing again, and replaced when a document changes.
#[test]
fn the_cache_is_reused_and_rebuilt_when_a_document_changes() {
    let t = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    corpus_dir(dir.path());

    let first = TextCorpus::open(dir.path(), &t).unwrap();
    assert!(!first.reused_cache());
    let cache = first.cache_path().to_path_buf();
    assert_eq!(cache.parent(), Some(dir.path()));
    assert!(
        cache
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with('.'),
        "{cache:?}"
    );
    assert_eq!(caches(dir.path()).len(), 1);
    let tokens = first.tokens().to_vec();
    assert_eq!(
        TokenFile::open(&cache, t.vocab_size()).unwrap().format(),
        TokenFormat::LlmC
    );
    drop(first);

    // Reused: the same file, and it is what is read — replace its ids (same documents) and
    // the next run returns the replacement instead of tokenizing again.
    let second = TextCorpus::open(dir.path(), &t).unwrap();
    assert!(second.reused_cache());
    assert_eq!(second.cache_path(), cache);
    assert_eq!(second.tokens().to_vec(), tokens);
    drop(second);
    // The same directory spelled another way is the same corpus.
    let respelled = dir.path().join("sub/..");
    assert!(TextCorpus::open(&respelled, &t).unwrap().reused_cache());
    write_tokens(&cache, &[7, 8, 9], TokenWidth::U16, TokenFormat::LlmC).unwrap();
    let third = TextCorpus::open(dir.path(), &t).unwrap();
    assert!(third.reused_cache());
    assert_eq!(third.tokens().to_vec(), [7, 8, 9]);
    drop(third);

    // A truncated cache is rebuilt.
    let bytes = fs::read(&cache).unwrap();
    fs::write(&cache, &bytes[..bytes.len() - 2]).unwrap();
    let rebuilt = TextCorpus::open(dir.path(), &t).unwrap();
    assert!(!rebuilt.reused_cache());
    assert_eq!(rebuilt.tokens().to_vec(), tokens);
    drop(rebuilt);

    // A changed document: a new cache with the new text, the stale one deleted.
    fs::write(
        dir.path().join("b.txt"),
        "Now we are engaged in a great civil war.",
    )
    .unwrap();
    let changed = TextCorpus::open(dir.path(), &t).unwrap();
    assert!(!changed.reused_cache());
    assert_ne!(changed.cache_path(), cache);
    let mut want = t.encode(DOC_A).unwrap();
    want.push(0);
    want.extend(
        t.encode("Now we are engaged in a great civil war.")
            .unwrap(),
    );
    want.push(0);
    assert_eq!(changed.tokens().to_vec(), want);
    assert_eq!(
        caches(dir.path()),
        [changed
            .cache_path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned()]
    );
    // A document added: rebuilt too.
    fs::write(dir.path().join("c.txt"), "x").unwrap();
    assert!(!TextCorpus::open(dir.path(), &t).unwrap().reused_cache());
}

#[test]
fn a_non_utf8_file_is_refused_naming_it() {
    let t = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("a.txt"), DOC_A).unwrap();
    let bad = dir.path().join("b.txt");
    fs::write(&bad, b"caf\xe9 latin-1").unwrap();
    let err = TextCorpus::open(dir.path(), &t).unwrap_err();
    assert!(
        matches!(&err, DataError::NotUtf8 { path, offset: 3 } if *path == bad),
        "{err:?}"
    );
    assert!(err.to_string().contains("b.txt"), "{err}");
    // No cache (nor a temporary file) is left behind.
    let left: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
}

#[test]
fn a_missing_path_or_an_empty_directory_is_refused_naming_it() {
    let t = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("corpus");
    let err = TextCorpus::open(&missing, &t).unwrap_err();
    assert!(
        matches!(&err, DataError::Missing { path } if *path == missing),
        "{err:?}"
    );
    assert!(err.to_string().contains("corpus"), "{err}");

    fs::create_dir(&missing).unwrap();
    fs::write(missing.join(".hidden"), "x").unwrap();
    let err = TextCorpus::open(&missing, &t).unwrap_err();
    assert!(
        matches!(&err, DataError::NoDocuments { path } if *path == missing),
        "{err:?}"
    );
}

/// `load_tokens`: a `.bin` is a token file, text otherwise.
#[test]
fn load_tokens_reads_bin_as_tokens_and_the_rest_as_text() {
    let t = tokenizer();
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("train.bin");
    write_tokens(&bin, &[3, 1, 4], TokenWidth::U16, TokenFormat::Raw).unwrap();
    assert_eq!(load_tokens(&bin, &t).unwrap().to_vec(), [3, 1, 4]);
    let txt = dir.path().join("train.txt");
    fs::write(&txt, DOC_A).unwrap();
    let mut want = t.encode(DOC_A).unwrap();
    want.push(t.eot_id().unwrap());
    assert_eq!(load_tokens(&txt, &t).unwrap().to_vec(), want);
}

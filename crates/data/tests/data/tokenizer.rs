use bonfire_data::{DataError, EOT_CANDIDATES, Tokenizer};

use crate::{fixture, tokenizer};

/// The fixture's `tokenizer.json` with `edit` applied to its text, saved in `dir`.
fn edited(dir: &std::path::Path, edit: impl FnOnce(String) -> String) -> std::path::PathBuf {
    let json = std::fs::read_to_string(fixture("tokenizer.json")).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, edit(json)).unwrap();
    path
}

/// The ids Rust gives are the ids Python's `tokenizers` gave (expected.json, written by
/// make_tokenizer.py): the same file means the same tokens in both.
#[test]
fn encode_matches_python_tokenizers() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap();
    let t = tokenizer();
    assert_eq!(
        t.vocab_size() as u64,
        expected["vocab_size"].as_u64().unwrap()
    );
    assert_eq!(
        u64::from(t.eot_id().unwrap()),
        expected["eot_id"].as_u64().unwrap()
    );
    let cases = expected["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 7, "expected.json lost its cases");
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(t.encode(text).unwrap(), want, "encoding {text:?}");
        // Byte-level BPE is lossless.
        assert_eq!(t.decode(&want).unwrap(), text);
    }
}

/// A special token written in the text is one id (as Python gives it); nothing else is
/// added around the text.
#[test]
fn encode_adds_no_special_tokens() {
    let t = tokenizer();
    let eot = t.eot_id().unwrap();
    let ids = t.encode("hello").unwrap();
    assert!(!ids.contains(&eot), "{ids:?}");
    let ids = t.encode("a<|endoftext|>b").unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == eot).count(), 1, "{ids:?}");
}

/// The end-of-text token is the first candidate the vocabulary has, added tokens count in
/// the vocabulary size, `with_eot` overrides, and a vocabulary without any candidate is an
/// error naming them all.
#[test]
fn eot_detection_order_override_and_absence() {
    let dir = tempfile::tempdir().unwrap();

    // Only the last candidate.
    let path = edited(dir.path(), |j| j.replace("<|endoftext|>", "<|eot_id|>"));
    let t = Tokenizer::from_file(&path).unwrap();
    assert_eq!(t.eot_id().unwrap(), 0);
    assert_eq!(t.token_to_id("<|endoftext|>"), None);

    // `</s>` (third) added at id 400 wins over `<|eot_id|>` (fifth) at 0.
    let path = edited(dir.path(), |j| {
        let mut v: serde_json::Value =
            serde_json::from_str(&j.replace("<|endoftext|>", "<|eot_id|>")).unwrap();
        let mut added = v["added_tokens"][0].clone();
        added["id"] = 400.into();
        added["content"] = "</s>".into();
        v["added_tokens"].as_array_mut().unwrap().push(added);
        v.to_string()
    });
    let t = Tokenizer::from_file(&path).unwrap();
    assert_eq!(t.eot_id().unwrap(), 400);
    assert_eq!(t.vocab_size(), 401, "the added token counts");
    // Named explicitly.
    let t = t.with_eot("<|eot_id|>").unwrap();
    assert_eq!(t.eot_id().unwrap(), 0);

    // None of the candidates.
    let path = edited(dir.path(), |j| j.replace("<|endoftext|>", "<|stop|>"));
    let t = Tokenizer::from_file(&path).unwrap();
    let err = t.eot_id().unwrap_err();
    assert!(matches!(err, DataError::NoEndOfText { .. }), "{err:?}");
    let msg = err.to_string();
    for c in EOT_CANDIDATES {
        assert!(msg.contains(c), "{msg}");
    }
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert_eq!(t.with_eot("<|stop|>").unwrap().eot_id().unwrap(), 0);

    // A token the vocabulary does not have.
    let err = tokenizer().with_eot("<|nope|>").unwrap_err();
    assert!(
        matches!(&err, DataError::UnknownToken { token, .. } if token == "<|nope|>"),
        "{err:?}"
    );
}

#[test]
fn a_missing_or_malformed_tokenizer_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere/tokenizer.json");
    let err = Tokenizer::from_file(&missing).unwrap_err();
    assert!(
        matches!(&err, DataError::Missing { path } if *path == missing),
        "{err:?}"
    );
    assert!(err.to_string().contains("nowhere/tokenizer.json"), "{err}");

    let bad = edited(dir.path(), |j| j[..j.len() / 2].to_string());
    let err = Tokenizer::from_file(&bad).unwrap_err();
    assert!(
        matches!(&err, DataError::Tokenizer { path, .. } if *path == bad),
        "{err:?}"
    );
}

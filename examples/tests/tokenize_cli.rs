//! The `tokenize` program: a directory of two documents and the data crate's tokenizer
//! fixture give a nanoGPT token file (u16 ids) that `bonfire_data` reads back as the
//! documents' tokens with the end-of-text token after each; a missing text path exits 2
//! naming it.

mod common;

use bonfire_data::{TokenFile, Tokenizer};
use std::process::Command;

#[test]
fn text_to_a_token_file_and_back() {
    let tokenizer_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/data/tests/fixtures/tokenizer.json"
    );
    let tokenizer = Tokenizer::from_file(tokenizer_path).unwrap();
    let dir = std::env::temp_dir().join(format!("bonfire-tokenize-{}", std::process::id()));
    let text = dir.join("text");
    std::fs::create_dir_all(&text).unwrap();
    std::fs::write(text.join("a.txt"), "We hold these truths").unwrap();
    std::fs::write(text.join("b.txt"), "Four score and seven years ago").unwrap();
    let out = dir.join("train.bin");
    let run = |text: &std::path::Path| {
        Command::new(common::example("tokenize"))
            .args(["--tokenizer", tokenizer_path, "--seq", "4", "--text"])
            .arg(text)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap()
    };
    let done = run(&text);
    let stdout = String::from_utf8_lossy(&done.stdout);
    assert!(
        done.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let eot = tokenizer.eot_id().unwrap();
    let mut want = tokenizer.encode("We hold these truths").unwrap();
    want.push(eot);
    want.extend(tokenizer.encode("Four score and seven years ago").unwrap());
    want.push(eot);
    let got = TokenFile::open(&out, tokenizer.vocab_size())
        .unwrap()
        .to_vec();
    assert_eq!(got, want);
    assert_eq!(
        std::fs::metadata(&out).unwrap().len() as usize,
        2 * want.len()
    );
    assert!(
        stdout.contains(&format!("documents=2 tokens={}", want.len())),
        "{stdout}"
    );
    let missing = run(&dir.join("nowhere"));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("nowhere"), "{stderr}");
    std::fs::remove_dir_all(dir).ok();
}

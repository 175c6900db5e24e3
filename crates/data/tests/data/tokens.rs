use std::path::Path;

use bonfire_data::{
    DataError, LLMC_HEADER_BYTES, LLMC_MAGIC, TokenFile, TokenFormat, TokenWidth, write_tokens,
};

/// An llm.c file built by hand (not by `TokenWriter`): header, then `tokens` of `width`.
fn llmc_bytes(version: i32, count: i32, tokens: &[u32], width: TokenWidth) -> Vec<u8> {
    let mut header = vec![0i32; 256];
    header[0] = 20240520;
    header[1] = version;
    header[2] = count;
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    for &t in tokens {
        match width {
            TokenWidth::U16 => bytes.extend((t as u16).to_le_bytes()),
            TokenWidth::U32 => bytes.extend(t.to_le_bytes()),
        }
    }
    bytes
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

#[test]
fn the_width_follows_the_vocabulary() {
    assert_eq!(TokenWidth::for_vocab(50257), TokenWidth::U16);
    assert_eq!(TokenWidth::for_vocab(65536), TokenWidth::U16);
    assert_eq!(TokenWidth::for_vocab(65537), TokenWidth::U32);
    assert_eq!(TokenWidth::for_vocab(128256), TokenWidth::U32);
}

/// nanoGPT's files: two little-endian bytes an id up to 65536 tokens, four above.
#[test]
fn raw_u16_and_u32_files_round_trip() {
    let dir = tempfile::tempdir().unwrap();

    let ids: Vec<u32> = vec![0, 1, 255, 256, 399, 7, 300];
    let path = dir.path().join("train.bin");
    write_tokens(&path, &ids, TokenWidth::U16, TokenFormat::Raw).unwrap();
    assert_eq!(size(&path), 2 * ids.len() as u64);
    // Little-endian on disk: 256 is 00 01.
    assert_eq!(&std::fs::read(&path).unwrap()[6..8], &[0, 1]);
    let file = TokenFile::open(&path, 400).unwrap();
    assert_eq!(file.to_vec(), ids);
    assert_eq!((file.len(), file.get(4)), (7, 399));
    assert_eq!(
        (file.width(), file.format()),
        (TokenWidth::U16, TokenFormat::Raw)
    );

    let ids: Vec<u32> = vec![65535, 65536, 0, 128255, 70000];
    let path = dir.path().join("big.bin");
    write_tokens(&path, &ids, TokenWidth::U32, TokenFormat::Raw).unwrap();
    assert_eq!(size(&path), 4 * ids.len() as u64);
    let file = TokenFile::open(&path, 128256).unwrap();
    assert_eq!(file.to_vec(), ids);
    assert_eq!(file.width(), TokenWidth::U32);

    // An empty file is zero tokens.
    let path = dir.path().join("empty.bin");
    std::fs::write(&path, b"").unwrap();
    assert!(TokenFile::open(&path, 400).unwrap().is_empty());
}

/// llm.c's files (hand-built, version 1 with u16 ids and 2 with u32) read past their
/// 1024-byte header; the writer writes the same bytes.
#[test]
fn llmc_files_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = vec![5, 0, 399, 42, 300, 1];

    let path = dir.path().join("v1.bin");
    std::fs::write(&path, llmc_bytes(1, 6, &ids, TokenWidth::U16)).unwrap();
    let file = TokenFile::open(&path, 400).unwrap();
    assert_eq!(file.to_vec(), ids);
    assert_eq!(
        (file.format(), file.width()),
        (TokenFormat::LlmC, TokenWidth::U16)
    );

    // Version 2: u32 ids even with a vocabulary that fits u16.
    let path = dir.path().join("v2.bin");
    std::fs::write(&path, llmc_bytes(2, 6, &ids, TokenWidth::U32)).unwrap();
    let file = TokenFile::open(&path, 400).unwrap();
    assert_eq!(file.to_vec(), ids);
    assert_eq!(file.width(), TokenWidth::U32);

    // The writer's bytes are the hand-built ones.
    let written = dir.path().join("written.bin");
    write_tokens(&written, &ids, TokenWidth::U16, TokenFormat::LlmC).unwrap();
    assert_eq!(
        std::fs::read(&written).unwrap(),
        llmc_bytes(1, 6, &ids, TokenWidth::U16)
    );
    assert_eq!(size(&written), LLMC_HEADER_BYTES as u64 + 12);
    assert_eq!(LLMC_MAGIC, 20240520);
}

#[test]
fn a_token_out_of_the_vocabulary_is_refused_naming_file_position_and_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("val.bin");
    write_tokens(
        &path,
        &[1, 2, 3, 399, 4, 400, 401],
        TokenWidth::U16,
        TokenFormat::Raw,
    )
    .unwrap();
    let err = TokenFile::open(&path, 400).unwrap_err();
    match &err {
        DataError::TokenOutOfVocab {
            path: p,
            position,
            token,
            vocab_size,
        } => assert_eq!((p, *position, *token, *vocab_size), (&path, 5, 400, 400)),
        other => panic!("{other:?}"),
    }
    let msg = err.to_string();
    for part in [
        &path.display().to_string(),
        "position 5",
        "token 400",
        "400 tokens",
    ] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
    // The same in an llm.c file (the position counts tokens, not bytes, after the header).
    std::fs::write(&path, llmc_bytes(1, 3, &[0, 500, 1], TokenWidth::U16)).unwrap();
    let err = TokenFile::open(&path, 400).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TokenOutOfVocab {
                position: 1,
                token: 500,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_wrong_llmc_header_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.bin");
    let ids = [1u32, 2, 3];
    for (count, version) in [(4, 1), (2, 1), (-1, 1), (3, 3)] {
        std::fs::write(&path, llmc_bytes(version, count, &ids, TokenWidth::U16)).unwrap();
        let err = TokenFile::open(&path, 400).unwrap_err();
        assert!(
            matches!(&err, DataError::BadHeader { path: p, .. } if *p == path),
            "count {count}, version {version}: {err:?}"
        );
        let msg = err.to_string();
        let named = if version == 3 {
            "version 3".to_string()
        } else {
            format!("counts {count} tokens")
        };
        assert!(msg.contains(&named), "{msg} lacks {named}");
    }
    // Truncated inside the header.
    std::fs::write(&path, &llmc_bytes(1, 3, &ids, TokenWidth::U16)[..100]).unwrap();
    let err = TokenFile::open(&path, 400).unwrap_err();
    assert!(matches!(err, DataError::BadHeader { .. }), "{err:?}");
}

#[test]
fn a_partial_token_or_a_missing_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.bin");
    std::fs::write(&path, [1u8, 0, 2]).unwrap();
    let err = TokenFile::open(&path, 400).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::BadLength {
                bytes: 3,
                width: 2,
                ..
            }
        ),
        "{err:?}"
    );

    let missing = dir.path().join("missing.bin");
    let err = TokenFile::open(&missing, 400).unwrap_err();
    assert!(
        matches!(&err, DataError::Missing { path } if *path == missing),
        "{err:?}"
    );
    assert!(err.to_string().contains("missing.bin"), "{err}");
}

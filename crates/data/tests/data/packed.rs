use bonfire_data::{DataError, PackedSequences, TokenFile, TokenFormat, TokenWidth, write_tokens};

/// Tokens 0..n: every token names its position, so every sequence is recognizable.
fn counting(n: u32) -> Vec<u32> {
    (0..n).collect()
}

/// The sequence (in file order) whose inputs are `inputs`.
fn which(inputs: &[i64], seq_len: usize) -> usize {
    inputs[0] as usize / seq_len
}

#[test]
fn inputs_and_targets_are_non_overlapping_windows_shifted_by_one() {
    let data = PackedSequences::new(counting(21), 4, 0).unwrap();
    assert_eq!(data.len(), 5); // 4·5 + 1 = 21 tokens exactly
    for i in 0..5 {
        let (inputs, targets) = data.sequence(i);
        let s = 4 * i as i64;
        assert_eq!(inputs, [s, s + 1, s + 2, s + 3]);
        assert_eq!(targets, [s + 1, s + 2, s + 3, s + 4]);
    }
    // The last partial window is dropped: 24 tokens hold 5 sequences, 25 hold 6.
    assert_eq!(PackedSequences::new(counting(24), 4, 0).unwrap().len(), 5);
    assert_eq!(PackedSequences::new(counting(25), 4, 0).unwrap().len(), 6);
    assert_eq!(PackedSequences::new(counting(5), 4, 0).unwrap().len(), 1);
}

#[test]
fn data_shorter_than_one_sequence_is_refused() {
    let err = PackedSequences::new(counting(4), 4, 0).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TooShort {
                tokens: 4,
                seq_len: 4,
                needed: 5
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("4 tokens") && msg.contains("at least 5"),
        "{msg}"
    );
    let err = PackedSequences::new(counting(10), 0, 0).unwrap_err();
    assert!(matches!(err, DataError::ZeroSeqLen), "{err:?}");
}

#[test]
fn the_shuffle_is_deterministic_per_seed_and_differs_between_seeds_and_epochs() {
    let a = PackedSequences::new(counting(401), 4, 1).unwrap();
    let b = PackedSequences::new(counting(401), 4, 1).unwrap();
    let c = PackedSequences::new(counting(401), 4, 2).unwrap();
    assert_eq!(a.len(), 100);
    assert_eq!(a.order(0), b.order(0));
    assert_eq!(a.batch(7, 8, 0..8), b.batch(7, 8, 0..8));
    assert_ne!(a.order(0), c.order(0));
    assert_ne!(a.batch(7, 8, 0..8), c.batch(7, 8, 0..8));
    assert_ne!(a.order(0), a.order(1));
    // Shuffled: not the file order.
    assert_ne!(&a.order(0)[..], &(0..100).collect::<Vec<_>>()[..]);
}

/// Read through `batch` over three epochs (a batch that does not divide an epoch), every
/// sequence comes exactly once per epoch, in that epoch's order.
#[test]
fn every_sequence_appears_exactly_once_per_epoch() {
    let data = PackedSequences::new(counting(41), 4, 9).unwrap();
    assert_eq!(data.len(), 10);
    let mut stream = Vec::new();
    for step in 0..10 {
        let (inputs, targets) = data.batch(step, 3, 0..3);
        assert_eq!((inputs.len(), targets.len()), (12, 12));
        for row in inputs.chunks(4) {
            stream.push(which(row, 4));
        }
    }
    assert_eq!(stream.len(), 30);
    for (epoch, seen) in stream.chunks(10).enumerate() {
        assert_eq!(seen, &data.order(epoch)[..], "epoch {epoch}");
        let mut sorted = seen.to_vec();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "epoch {epoch}");
    }
}

/// Step s is positions s·B..(s+1)·B of the stream: a batch that straddles the end of an
/// epoch finishes it and starts the next, and a run started fresh at step s reads the same.
#[test]
fn a_step_continues_across_the_epoch_boundary_and_on_resume() {
    let data = PackedSequences::new(counting(41), 4, 3).unwrap();
    let (e0, e1) = (data.order(0), data.order(1));
    assert_eq!(data.position(2, 4), (0, 8));
    assert_eq!(data.position(3, 4), (1, 2));
    assert_eq!(data.position(5, 4), (2, 0));
    let (inputs, targets) = data.batch(2, 4, 0..4);
    let rows: Vec<usize> = inputs.chunks(4).map(|r| which(r, 4)).collect();
    assert_eq!(rows, [e0[8], e0[9], e1[0], e1[1]]);
    for (i, t) in inputs.iter().zip(&targets) {
        assert_eq!(*t, i + 1);
    }

    // Resumed: a new instance (nothing cached) asked for step 7 first reads what the one
    // that ran steps 0..7 does.
    for step in 0..8 {
        let _ = data.batch(step, 4, 0..4);
    }
    let resumed = PackedSequences::new(counting(41), 4, 3).unwrap();
    assert_eq!(resumed.batch(7, 4, 0..4), data.batch(7, 4, 0..4));
    // A batch larger than an epoch spans three.
    let (inputs, _) = data.batch(1, 25, 0..25);
    let rows: Vec<usize> = inputs.chunks(4).map(|r| which(r, 4)).collect();
    let e2 = data.order(2);
    let e3 = data.order(3);
    let want: Vec<usize> = e2[5..]
        .iter()
        .chain(&e3[..])
        .chain(&data.order(4)[..])
        .copied()
        .collect();
    assert_eq!(rows, want);
}

/// dp replicas reading their own rows get exactly their slice of the global batch.
#[test]
fn a_replicas_rows_are_its_slice_of_the_global_batch() {
    let data = PackedSequences::new(counting(201), 5, 11).unwrap();
    assert_eq!(data.len(), 40);
    for step in [0, 4, 5, 9] {
        // 8 × step crosses epochs of 40 at step 5.
        let (all_in, all_tg) = data.batch(step, 8, 0..8);
        let (mut parts_in, mut parts_tg) = (Vec::new(), Vec::new());
        for rank in 0..4 {
            let (i, t) = data.batch(step, 8, 2 * rank..2 * rank + 2);
            assert_eq!(i.len(), 2 * 5);
            assert_eq!(i, all_in[10 * rank..10 * rank + 10]);
            parts_in.extend(i);
            parts_tg.extend(t);
        }
        assert_eq!((parts_in, parts_tg), (all_in, all_tg), "step {step}");
    }
    assert_eq!(data.batch(3, 8, 4..4), (vec![], vec![]));
}

#[test]
#[should_panic(expected = "rows 6..9 of a global batch of 8")]
fn rows_beyond_the_global_batch_panic() {
    let data = PackedSequences::new(counting(41), 4, 0).unwrap();
    let _ = data.batch(0, 8, 6..9);
}

/// A memory-mapped file packs exactly as the same ids in memory.
#[test]
fn a_token_file_packs_like_memory() {
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<u32> = (0..301).map(|i| (i * 7 + 3) % 400).collect();
    for (width, format) in [
        (TokenWidth::U16, TokenFormat::Raw),
        (TokenWidth::U16, TokenFormat::LlmC),
    ] {
        let path = dir.path().join(format!("{format:?}.bin"));
        write_tokens(&path, &ids, width, format).unwrap();
        let file = PackedSequences::new(TokenFile::open(&path, 400).unwrap(), 6, 5).unwrap();
        let memory = PackedSequences::new(ids.clone(), 6, 5).unwrap();
        assert_eq!(file.len(), 50);
        for step in [0, 3, 12] {
            assert_eq!(file.batch(step, 8, 0..8), memory.batch(step, 8, 0..8));
        }
    }
    // Too short from a file too.
    let path = dir.path().join("short.bin");
    write_tokens(&path, &ids[..6], TokenWidth::U16, TokenFormat::Raw).unwrap();
    let err = PackedSequences::new(TokenFile::open(&path, 400).unwrap(), 6, 5).unwrap_err();
    assert!(
        matches!(
            err,
            DataError::TooShort {
                tokens: 6,
                needed: 7,
                ..
            }
        ),
        "{err:?}"
    );
}

/// Ranks that are threads share one `PackedSequences`.
#[test]
fn packed_sequences_are_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<PackedSequences>();
}

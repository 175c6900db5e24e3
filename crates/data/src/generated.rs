//! A small text corpus generated in code (no download, no file in the repository), a
//! character tokenizer for it, and seeded random windows of it, so the main job trains on
//! real, learnable text anywhere.
//!
//! The text is sentences from a little grammar (subjects, verbs, objects, places), enough
//! structure for a small GPT to drive its loss well below the uniform `ln(vocab)`.

/// Characters of the corpus; the token of a character is its index here.
pub const ALPHABET: &str = " abcdefghijklmnopqrstuvwxyz.,\n";

const SUBJECTS: &[&str] = &[
    "the fox",
    "a small bird",
    "the old dog",
    "my neighbour",
    "the cat",
    "a young girl",
    "the farmer",
    "a tired horse",
    "the teacher",
    "our captain",
];
const VERBS: &[&str] = &[
    "jumps over",
    "looks at",
    "runs past",
    "sings to",
    "waits for",
    "follows",
    "paints",
    "carries",
    "finds",
    "remembers",
];
const OBJECTS: &[&str] = &[
    "the lazy dog",
    "a red apple",
    "the river",
    "an open door",
    "the green hill",
    "a quiet song",
    "the morning light",
    "a wooden boat",
    "the last train",
    "a paper map",
];
const PLACES: &[&str] = &[
    "in the garden",
    "near the sea",
    "after the rain",
    "before dawn",
    "under the bridge",
    "at the market",
    "in winter",
    "by the fire",
];

/// A deterministic pseudo-random stream (SplitMix64), so every rank and run sees the same
/// corpus and the same batches.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A stream starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    /// A number in `0..n` (`n` must be positive).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// About `chars` characters of generated sentences.
pub fn generate(chars: usize, seed: u64) -> String {
    let mut rng = Rng::new(seed);
    let mut text = String::with_capacity(chars + 80);
    while text.len() < chars {
        let mut pick = |list: &[&'static str]| list[rng.below(list.len())];
        let s = pick(SUBJECTS);
        let v = pick(VERBS);
        let o = pick(OBJECTS);
        let p = pick(PLACES);
        text.push_str(&format!("{s} {v} {o} {p}."));
        text.push(if rng.below(4) == 0 { '\n' } else { ' ' });
    }
    text
}

/// Character-level tokenizer over [`ALPHABET`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CharTokenizer;

impl CharTokenizer {
    /// Number of token ids: the length of [`ALPHABET`].
    pub fn vocab_size(&self) -> usize {
        ALPHABET.len()
    }
    /// Each character's index in [`ALPHABET`]; characters outside it are dropped.
    pub fn encode(&self, text: &str) -> Vec<i64> {
        text.chars()
            .filter_map(|c| ALPHABET.find(c).map(|i| i as i64))
            .collect()
    }
    /// The characters of `ids` (each must be below [`CharTokenizer::vocab_size`]).
    pub fn decode(&self, ids: &[i64]) -> String {
        ids.iter()
            .map(|&i| ALPHABET.as_bytes()[i as usize] as char)
            .collect()
    }
}

/// `batch` random windows of `seq + 1` tokens of `tokens`: the inputs and their next-token
/// targets, each `batch × seq` ids, row by row.
pub fn windows(tokens: &[i64], batch: usize, seq: usize, rng: &mut Rng) -> (Vec<i64>, Vec<i64>) {
    let mut ids = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let start = rng.below(tokens.len() - seq - 1);
        ids.extend_from_slice(&tokens[start..start + seq]);
        targets.extend_from_slice(&tokens[start + 1..start + seq + 1]);
    }
    (ids, targets)
}

/// The windows of step `step`: `rows` of them drawn with a generator seeded by (`seed`,
/// `step`), so every rank and every layout trains on the same batches.
pub fn step_windows(
    tokens: &[i64],
    rows: usize,
    seq: usize,
    seed: u64,
    step: usize,
) -> (Vec<i64>, Vec<i64>) {
    let mut rng = Rng::new(seed ^ (step as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    windows(tokens, rows, seq, &mut rng)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corpus_round_trips_through_the_tokenizer() {
        let text = generate(2000, 1);
        assert!(text.len() >= 2000);
        let tok = CharTokenizer;
        assert_eq!(tok.decode(&tok.encode(&text)), text);
        assert_eq!(generate(500, 7), generate(500, 7));
    }
}

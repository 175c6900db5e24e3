//! The gate's count of tests: every `cargo test` run's `test result:` lines, plus one test per
//! check that runs outside the test harness (an MPI job, a failure scenario, a comparison of
//! runs). `cargo xtask test` ends with the total as one plain line, `N passed, N failed, N
//! skipped`: a test the harness ignored (a GPU test on a machine without one) and a step that
//! could not run outside CI are counted as skipped, never as passed.

use std::sync::Mutex;

/// Passed, failed and skipped tests so far.
static TALLY: Mutex<[usize; 3]> = Mutex::new([0; 3]);

/// The test binary running now and each finished one's wall time (`Running tests/x.rs (…)`
/// then `… finished in 1.23s`), so the gate can name its slowest suites.
struct Suites {
    running: Option<String>,
    finished: Vec<(String, f64)>,
}

static SUITES: Mutex<Suites> = Mutex::new(Suites {
    running: None,
    finished: Vec::new(),
});

/// Notes a `cargo test` output line that starts a test binary or ends it with its time.
pub fn time_line(line: &str) {
    let line = line.trim();
    let mut suites = SUITES.lock().unwrap();
    if let Some(rest) = line
        .strip_prefix("Running ")
        .or_else(|| line.strip_prefix("Doc-tests "))
    {
        let name = rest.split_whitespace().next().unwrap_or(rest);
        suites.running = Some(name.to_owned());
    } else if let Some((_, time)) = line.rsplit_once("finished in ") {
        let seconds = time.trim_end_matches('s').parse::<f64>();
        if let (Some(name), Ok(seconds)) = (suites.running.take(), seconds) {
            suites.finished.push((name, seconds));
        }
    }
}

/// The `n` slowest test binaries so far, slowest first: `tests/loss_curves.rs 120 s, …`.
pub fn slowest(n: usize) -> String {
    let mut all = SUITES.lock().unwrap().finished.clone();
    all.sort_by(|a, b| b.1.total_cmp(&a.1));
    let each: Vec<String> = all
        .iter()
        .take(n)
        .map(|(name, s)| format!("{name} {s:.0} s"))
        .collect();
    each.join(", ")
}

/// Adds `passed` and `failed` tests.
pub fn add(passed: usize, failed: usize) {
    let mut t = TALLY.lock().unwrap();
    t[0] += passed;
    t[1] += failed;
}

/// Adds `n` tests that did not run.
pub fn skip(n: usize) {
    TALLY.lock().unwrap()[2] += n;
}

/// Counts the tests of one `cargo test` output line (`test result: ok. 3 passed; 1 failed; …`),
/// its ignored tests as skipped. Returns whether the line was such a summary.
pub fn count_line(line: &str) -> bool {
    let Some(rest) = line.trim().strip_prefix("test result: ") else {
        return false;
    };
    let number = |word: &str| -> usize {
        rest.split(';')
            .map(str::trim)
            .find_map(|part| {
                let part = part
                    .trim_start_matches("ok.")
                    .trim_start_matches("FAILED.")
                    .trim();
                part.strip_suffix(word)?.trim().parse().ok()
            })
            .unwrap_or(0)
    };
    add(number("passed"), number("failed"));
    skip(number("ignored"));
    true
}

/// Tests failed so far.
pub fn failed() -> usize {
    TALLY.lock().unwrap()[1]
}

/// The total line.
pub fn total() -> String {
    let [passed, failed, skipped] = *TALLY.lock().unwrap();
    format!("{passed} passed, {failed} failed, {skipped} skipped")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cargo_summaries() {
        assert!(count_line(
            "test result: ok. 13 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 0.42s"
        ));
        assert!(count_line(
            "test result: FAILED. 7 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out"
        ));
        assert!(!count_line("running 3 tests"));
        skip(1);
        assert_eq!(total(), "20 passed, 2 failed, 3 skipped");
    }

    #[test]
    fn times_test_binaries() {
        time_line("     Running tests/fast.rs (target/debug/deps/fast-0a1b)");
        time_line("test result: ok. 1 passed; 0 failed; 0 ignored; finished in 0.50s");
        time_line("     Running tests/slow.rs (target/debug/deps/slow-0a1b)");
        time_line("test result: ok. 1 passed; 0 failed; 0 ignored; finished in 12.00s");
        assert_eq!(slowest(1), "tests/slow.rs 12 s");
    }
}

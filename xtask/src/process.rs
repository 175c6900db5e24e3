//! Running child processes with inherited stdio and turning their exit status
//! into an error that names what failed.

use std::ffi::OsStr;
use std::fmt;
use std::process::Command;

/// Why an xtask subcommand failed, and the exit code `cargo xtask` should end with.
///
/// The exit code of a failed child process is propagated so that callers (CI,
/// scripts) see the same status the underlying tool reported.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub exit_code: u8,
}

impl Failure {
    /// A failure caused by how xtask was invoked (unknown target, ...): exit code 2, like clap.
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            exit_code: 2,
        }
    }
}

pub type Result<T = ()> = std::result::Result<T, Failure>;

/// The cargo binary to invoke: the one running us (`$CARGO`, set by `cargo run`)
/// so that toolchain overrides are respected, falling back to `cargo` on PATH.
///
/// In CI (a fresh clone built once) incremental compilation only costs disk, so it is off.
pub fn cargo() -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    if std::env::var_os("CI").is_some() {
        command.env("CARGO_INCREMENTAL", "0");
    }
    command
}

/// Free bytes on the file system holding `path`, from `df`; `None` where `df` cannot say.
pub fn free_bytes(path: &std::path::Path) -> Option<u64> {
    let output = Command::new("df").arg("-Pk").arg(path).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let kib: u64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Runs a `cargo test` command like [`run`], echoing its standard output line by line and
/// counting the tests of its `test result:` lines in [`crate::tally`].
pub fn run_tests(command: Command) -> Result {
    run_echoed(command, |line| {
        crate::tally::count_line(line);
        crate::tally::time_line(line);
    })
}

/// Runs `command` like [`run`], its standard output and error echoed line by line, in the order
/// written, and each line handed to `each`.
pub fn run_echoed(mut command: Command, mut each: impl FnMut(&str)) -> Result {
    use std::io::{BufRead, BufReader};
    let shown = CommandLine(&command).to_string();
    println!("$ {shown}");
    let fail = |err: std::io::Error| Failure {
        message: format!("could not start `{shown}`: {err}"),
        exit_code: 1,
    };
    // One pipe for both streams, in the order written: cargo names each test binary
    // (`Running tests/x.rs`) on stderr, the binary reports its result on stdout.
    let (reader, writer) = std::io::pipe().map_err(fail)?;
    command.stdout(writer.try_clone().map_err(fail)?);
    command.stderr(writer);
    let mut child = command.spawn().map_err(fail)?;
    // The command holds the pipe's write ends: dropped, the child's are the last ones, so the
    // reader ends when the child does.
    drop(command);
    for line in BufReader::new(reader)
        .lines()
        .map_while(std::io::Result::ok)
    {
        println!("{line}");
        each(&line);
    }
    let status = child.wait().map_err(|err| Failure {
        message: format!("`{shown}`: {err}"),
        exit_code: 1,
    })?;
    check(status, &shown)
}

/// The workspace's root folder (xtask's parent).
pub fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn check(status: std::process::ExitStatus, shown: &str) -> Result {
    if status.success() {
        return Ok(());
    }
    let exit_code = status
        .code()
        .and_then(|code| u8::try_from(code).ok())
        .filter(|&code| code != 0)
        .unwrap_or(1);
    Err(Failure {
        message: format!("`{shown}` failed ({status})"),
        exit_code,
    })
}

/// Runs `command` to completion with inherited stdio.
///
/// Succeeds only if the process exits with status 0; otherwise the returned
/// failure carries the child's exit code (1 if it was killed by a signal).
pub fn run(mut command: Command) -> Result {
    let shown = CommandLine(&command).to_string();
    println!("$ {shown}");
    let status = command.status().map_err(|err| Failure {
        message: format!("could not start `{shown}`: {err}"),
        exit_code: 1,
    })?;
    check(status, &shown)
}

/// Displays a command the way a user would type it, including environment overrides.
struct CommandLine<'a>(&'a Command);

impl fmt::Display for CommandLine<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (key, value) in self.0.get_envs() {
            if let Some(value) = value {
                write!(f, "{}={} ", key.to_string_lossy(), value.to_string_lossy())?;
            }
        }
        // Show `cargo` rather than the absolute path from `$CARGO`.
        let program = self.0.get_program();
        let program = std::path::Path::new(program).file_stem().unwrap_or(program);
        write!(f, "{}", program.to_string_lossy())?;
        for arg in self.0.get_args() {
            write!(f, " {}", quote(arg))?;
        }
        Ok(())
    }
}

fn quote(arg: &OsStr) -> String {
    let arg = arg.to_string_lossy();
    if arg.is_empty() || arg.contains(char::is_whitespace) {
        format!("'{arg}'")
    } else {
        arg.into_owned()
    }
}

#[cfg(test)]
mod tests {
    /// A cargo-like run: the binary's name on stderr, its time on stdout, both read in order
    /// (no `test result:` line, which would count tests beside the tally's own test).
    #[test]
    fn reads_both_streams_of_a_test_run() {
        let mut command = std::process::Command::new("sh");
        command.args([
            "-c",
            "echo '     Running tests/piped.rs (x)' >&2; \
             echo 'all ok; finished in 7.00s'",
        ]);
        super::run_tests(command).unwrap_or_else(|e| panic!("{}", e.message));
        assert!(crate::tally::slowest(50).contains("tests/piped.rs 7 s"));
    }
}

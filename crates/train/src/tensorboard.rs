//! [`TensorBoard`]: the loop's scalars as TensorBoard event files (`--tensorboard DIR`), read
//! by TensorBoard itself (`tensorboard --logdir DIR`) and by its Python reader.
//!
//! An event file is TFRecord framing of serialized `tensorflow.Event` protocol buffers: each
//! record is its length (u64, little endian), the masked CRC-32C of that length, the bytes,
//! their masked CRC-32C. The first event names the format (`brain.Event:2`); each later one
//! holds a step, a wall time and a `Summary` of tagged scalars. The messages are declared here
//! with `prost` (the fields TensorBoard reads, by their numbers in TensorFlow's `event.proto`
//! and `summary.proto`); `crc32c` computes the checksums.

use crate::engine::Engine;
use crate::error::TrainError;
use crate::fit::{Hooks, StepReport};
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// `tensorflow.Event`: a wall time, a step and what happened.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    /// The file's format, in its first event.
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`: tagged values.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<Value>,
}

/// `tensorflow.Summary.Value` holding a `simple_value` (always written, 0 included).
#[derive(Clone, PartialEq, prost::Message)]
struct Value {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: length, its checksum, the bytes, their checksum.
fn record(bytes: &[u8]) -> Vec<u8> {
    let len = (bytes.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(bytes.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(bytes);
    out.extend_from_slice(&masked_crc(bytes).to_le_bytes());
    out
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An event file being written (rank 0's). Clones share the file: the loop's hook writes the
/// training scalars, [`crate::Evaluation::with_tensorboard`] the evaluation loss.
#[derive(Clone)]
pub struct TensorBoard {
    file: Arc<Mutex<std::fs::File>>,
    path: PathBuf,
}

impl TensorBoard {
    /// A new event file in `dir` (created if need be), named as TensorBoard looks for them
    /// (`events.out.tfevents.<seconds>.<host>.<pid>`), its first event written.
    pub fn create(dir: &Path) -> Result<Self, TrainError> {
        let io = |e: std::io::Error| TrainError::Io(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            now() as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::File::create(&path).map_err(io)?;
        let board = Self {
            file: Arc::new(Mutex::new(file)),
            path,
        };
        board.event(0, What::FileVersion("brain.Event:2".into()))?;
        Ok(board)
    }

    /// The event file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `values` (tag, value) as one event at `step`, flushed.
    pub fn scalars(&self, step: usize, values: &[(&str, f64)]) -> Result<(), TrainError> {
        let value = values
            .iter()
            .map(|&(tag, v)| Value {
                tag: tag.to_string(),
                simple_value: Some(v as f32),
            })
            .collect();
        self.event(step, What::Summary(Summary { value }))
    }

    fn event(&self, step: usize, what: What) -> Result<(), TrainError> {
        let event = Event {
            wall_time: now(),
            step: step as i64,
            what: Some(what),
        };
        let bytes = record(&event.encode_to_vec());
        let mut file = self.file.lock().expect("the event file's lock");
        file.write_all(&bytes)
            .and_then(|_| file.flush())
            .map_err(|e| TrainError::Io(format!("{}: {e}", self.path.display())))
    }
}

/// After each step: `train/loss`, `train/lr`, and where measured `train/grad_norm`,
/// `train/tokens_per_s`, `train/step_ms`, `train/peak_rss_bytes`, at the step's number.
impl<B> Hooks<B> for TensorBoard {
    fn after_step(&mut self, r: &StepReport, _: &mut dyn Engine<B>) -> Result<(), TrainError> {
        let mut values = vec![
            ("train/loss", f64::from(r.loss)),
            ("train/lr", r.lr),
            ("train/step_ms", r.step_ms),
        ];
        let optional = [
            ("train/grad_norm", r.grad_norm),
            ("train/tokens_per_s", r.tokens_per_s),
            ("train/peak_rss_bytes", r.peak_rss_bytes.map(|b| b as f64)),
        ];
        values.extend(optional.into_iter().filter_map(|(t, v)| Some((t, v?))));
        self.scalars(r.step, &values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_carry_tfrecord_checksums() {
        // TFRecord's masked CRC of an empty payload and the framing's layout.
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        let crc = u32::from_le_bytes(r[15..19].try_into().unwrap());
        assert_eq!(
            crc,
            crc32c::crc32c(b"abc")
                .rotate_right(15)
                .wrapping_add(0xa282_ead8)
        );
    }
}

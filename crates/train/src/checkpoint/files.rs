//! The data files: safetensors written with a CRC-32 per block and synced to disk, and read
//! back by byte range — the header first, then only the blocks holding the wanted elements,
//! each checked against the index's checksum before a byte of it is used.

use super::CheckpointError;
use super::index::FileRecord;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

#[cfg(target_endian = "big")]
compile_error!("checkpoint files are little-endian f32; a big-endian target would need a swap");

/// A test-only failure injected into a save: the process aborts at that point, as a killed
/// job would (no unwinding, no cleanup).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Rank `rank` aborts halfway through writing its data file.
    MidFile { rank: usize },
    /// Rank 0 aborts after every data file is written, before the index.
    BeforeIndex,
    /// Rank 0 aborts after writing the index, before the rename that makes it visible.
    BeforeRename,
}

/// Aborts the process (a fault injected on purpose).
pub(crate) fn abort(what: &str) -> ! {
    eprintln!("checkpoint fault injected: aborting {what}");
    std::process::abort()
}

/// Writes `tensors` (key, shape, values) as one safetensors file at `path`, synced; returns
/// its size and block checksums (named `name`). `abort_midway` aborts halfway.
pub(crate) fn write_tensors(
    path: &Path,
    name: &str,
    tensors: &[(String, Vec<usize>, &[f32])],
    block_bytes: u64,
    abort_midway: bool,
) -> Result<FileRecord, CheckpointError> {
    let views = tensors
        .iter()
        .map(|(key, shape, values)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(values))
                .map_err(|e| CheckpointError::Corrupt(format!("{key}: {e}")))?;
            Ok((key.clone(), view))
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| CheckpointError::Corrupt(format!("{}: {e}", path.display())))?;
    let mut file = File::create(path).map_err(|e| CheckpointError::io(path, e))?;
    let mut block_crc32 = Vec::new();
    for (i, block) in bytes.chunks(block_bytes as usize).enumerate() {
        if abort_midway && (i + 1) * block_bytes as usize >= bytes.len() / 2 {
            file.write_all(&block[..block.len() / 2])
                .and_then(|_| file.sync_all())
                .map_err(|e| CheckpointError::io(path, e))?;
            abort(&format!("halfway through {}", path.display()));
        }
        file.write_all(block)
            .map_err(|e| CheckpointError::io(path, e))?;
        block_crc32.push(crc32fast::hash(block));
    }
    file.sync_all().map_err(|e| CheckpointError::io(path, e))?;
    Ok(FileRecord {
        name: name.to_string(),
        bytes: bytes.len() as u64,
        block_bytes,
        block_crc32,
    })
}

/// Writes `bytes` to `path` through a temporary name, synced, then renamed into place.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("tmp");
    let mut file = File::create(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| CheckpointError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Syncs a directory (its entries: new names, renames).
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| CheckpointError::io(dir, e))
}

/// Where one tensor's data lies in its file (absolute byte offsets).
#[derive(Debug, Clone, Copy)]
struct Located {
    start: u64,
    end: u64,
}

/// A data file being read: its record, the tensors its header lists, and the blocks read so
/// far (each checked).
pub(crate) struct DataFile {
    path: PathBuf,
    record: FileRecord,
    file: File,
    tensors: HashMap<String, Located>,
    blocks: HashMap<u64, Vec<u8>>,
    /// Bytes read from disk.
    pub bytes_read: u64,
}

impl DataFile {
    /// Opens `record`'s file in `dir`: checks its size and reads its header (checked).
    pub fn open(dir: &Path, record: &FileRecord) -> Result<Self, CheckpointError> {
        let path = dir.join(&record.name);
        let file = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => CheckpointError::Missing(format!(
                "{}: the index lists this data file but it is not there",
                path.display()
            )),
            _ => CheckpointError::io(&path, e),
        })?;
        let size = file
            .metadata()
            .map_err(|e| CheckpointError::io(&path, e))?
            .len();
        if size != record.bytes {
            return Err(CheckpointError::Corrupt(format!(
                "{}: {size} bytes, the index says {} (truncated or overwritten)",
                path.display(),
                record.bytes
            )));
        }
        let blocks_needed = record.bytes.div_ceil(record.block_bytes.max(1));
        if record.block_bytes == 0 || record.block_crc32.len() as u64 != blocks_needed {
            return Err(CheckpointError::Corrupt(format!(
                "{}: the index's block checksums do not fit the file",
                path.display()
            )));
        }
        let mut f = Self {
            path,
            record: record.clone(),
            file,
            tensors: HashMap::new(),
            blocks: HashMap::new(),
            bytes_read: 0,
        };
        f.read_header()?;
        Ok(f)
    }

    fn corrupt(&self, why: impl std::fmt::Display) -> CheckpointError {
        CheckpointError::Corrupt(format!("{}: {why}", self.path.display()))
    }

    fn read_header(&mut self) -> Result<(), CheckpointError> {
        let mut n = [0u8; 8];
        self.read(0, &mut n)?;
        let n = u64::from_le_bytes(n);
        if n.checked_add(8).is_none_or(|end| end > self.record.bytes) {
            return Err(self.corrupt(format!("a header of {n} bytes does not fit the file")));
        }
        let mut header = vec![0u8; n as usize];
        self.read(8, &mut header)?;
        let map: HashMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| self.corrupt(e))?;
        let data_start = 8 + n;
        for (key, info) in map {
            if key == "__metadata__" {
                continue;
            }
            let dtype = info.get("dtype").and_then(|d| d.as_str());
            let offsets = info
                .get("data_offsets")
                .and_then(|o| serde_json::from_value::<[u64; 2]>(o.clone()).ok());
            let (Some("F32"), Some([a, b])) = (dtype, offsets) else {
                return Err(self.corrupt(format!("`{key}`: not an f32 tensor with offsets")));
            };
            let (start, end) = (data_start + a, data_start + b);
            if a > b || end > self.record.bytes {
                return Err(self.corrupt(format!("`{key}`: data outside the file")));
            }
            self.tensors.insert(key, Located { start, end });
        }
        Ok(())
    }

    /// Bytes `at .. at + out.len()` of the file, through checked blocks.
    fn read(&mut self, at: u64, out: &mut [u8]) -> Result<(), CheckpointError> {
        let bb = self.record.block_bytes;
        let end = at + out.len() as u64;
        let mut pos = at;
        while pos < end {
            let b = pos / bb;
            self.load_block(b)?;
            let block = &self.blocks[&b];
            let from = (pos - b * bb) as usize;
            let n = (block.len() - from).min((end - pos) as usize);
            let dst = (pos - at) as usize;
            out[dst..dst + n].copy_from_slice(&block[from..from + n]);
            pos += n as u64;
        }
        Ok(())
    }

    fn load_block(&mut self, b: u64) -> Result<(), CheckpointError> {
        if self.blocks.contains_key(&b) {
            return Ok(());
        }
        let bb = self.record.block_bytes;
        let len = bb.min(self.record.bytes - b * bb) as usize;
        let mut buf = vec![0u8; len];
        self.file
            .seek(SeekFrom::Start(b * bb))
            .and_then(|_| self.file.read_exact(&mut buf))
            .map_err(|e| CheckpointError::io(&self.path, e))?;
        self.bytes_read += len as u64;
        let crc = crc32fast::hash(&buf);
        if crc != self.record.block_crc32[b as usize] {
            return Err(self.corrupt(format!(
                "block {b} (bytes {}..{}) has checksum {crc:08x}, the index says {:08x} (corrupted)",
                b * bb,
                b * bb + len as u64,
                self.record.block_crc32[b as usize]
            )));
        }
        self.blocks.insert(b, buf);
        Ok(())
    }

    /// Elements `src .. src + out.len()` of tensor `key`, which must hold `elements` f32s.
    pub fn read_f32(
        &mut self,
        key: &str,
        elements: usize,
        src: usize,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let t = *self
            .tensors
            .get(key)
            .ok_or_else(|| self.corrupt(format!("no tensor `{key}` (the index lists it)")))?;
        if t.end - t.start != elements as u64 * 4 {
            return Err(self.corrupt(format!(
                "`{key}` holds {} bytes, the index says {elements} f32 values",
                t.end - t.start
            )));
        }
        let at = t.start + src as u64 * 4;
        self.read(at, bytemuck::cast_slice_mut(out))
    }
}

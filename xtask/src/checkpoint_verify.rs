//! A Bonfire checkpoint checked from outside, without Bonfire's crates (xtask depends on none
//! of them): the index (`index.json`) lists each data file's size and a CRC-32 per block
//! (`block_bytes` each, the last one shorter), and where each slice lies (`tensors[].chunks[]`:
//! a file number and a key). Every block of every file must match its checksum, and every
//! key the index names must be an f32 tensor in its file's safetensors header. The format is
//! `crates/train/src/checkpoint/` (docs/checkpoint.md).

use crate::mpi_train::fail;
use crate::process::Result;
use serde_json::Value;
use std::path::Path;

fn crc32(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Checks the checkpoint in `dir` (see the module docs); returns the number of blocks
/// checked. An error names the checkpoint, the file and the block.
pub fn verify_checkpoint(dir: &Path) -> Result<usize> {
    let where_ = dir.display();
    let path = dir.join("index.json");
    let text = std::fs::read_to_string(&path).map_err(|e| fail(format!("{where_}: {e}")))?;
    let index: Value =
        serde_json::from_str(&text).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    let files = index["files"]
        .as_array()
        .filter(|f| !f.is_empty())
        .ok_or_else(|| fail(format!("{}: no data files listed", path.display())))?;
    let mut headers = Vec::new();
    let mut blocks = 0;
    for file in files {
        let (checked, header) = verify_file(dir, file)?;
        blocks += checked;
        headers.push(header);
    }
    let chunks = index["tensors"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| t["chunks"].as_array().into_iter().flatten());
    let mut keys = 0;
    for chunk in chunks {
        let (Some(file), Some(key)) = (chunk["file"].as_u64(), chunk["key"].as_str()) else {
            return Err(fail(format!(
                "{where_}: a chunk without file or key: {chunk}"
            )));
        };
        let header = headers
            .get(file as usize)
            .ok_or_else(|| fail(format!("{where_}: `{key}` in file #{file}, not listed")))?;
        if header[key]["dtype"].as_str() != Some("F32") {
            return Err(fail(format!(
                "{where_}: `{key}` is not an f32 tensor of file #{file}"
            )));
        }
        keys += 1;
    }
    if keys == 0 {
        return Err(fail(format!("{where_}: the index lists no slices")));
    }
    Ok(blocks)
}

/// One data file against its index record: its size, every block's CRC-32; returns the
/// number of blocks and the file's safetensors header.
fn verify_file(dir: &Path, record: &Value) -> Result<(usize, Value)> {
    let (Some(name), Some(bytes), Some(block_bytes), Some(crcs)) = (
        record["name"].as_str(),
        record["bytes"].as_u64(),
        record["block_bytes"].as_u64().filter(|&b| b > 0),
        record["block_crc32"].as_array(),
    ) else {
        return Err(fail(format!(
            "{}: a file record without name, size, block size or checksums: {record}",
            dir.display()
        )));
    };
    let at = dir.join(name);
    let data = std::fs::read(&at).map_err(|e| fail(format!("{}: {e}", at.display())))?;
    if data.len() as u64 != bytes || crcs.len() as u64 != bytes.div_ceil(block_bytes) {
        return Err(fail(format!(
            "{}: {} bytes, {} checksums; the index says {bytes} bytes in blocks of {block_bytes}",
            at.display(),
            data.len(),
            crcs.len()
        )));
    }
    for (b, (block, want)) in data.chunks(block_bytes as usize).zip(crcs).enumerate() {
        let crc = crc32(block);
        if Some(crc as u64) != want.as_u64() {
            let from = b as u64 * block_bytes;
            return Err(fail(format!(
                "{}: block {b} (bytes {from}..{}) has CRC-32 {crc:08x}, the index says {want} \
                 (corrupted)",
                at.display(),
                from + block.len() as u64
            )));
        }
    }
    Ok((crcs.len(), header(&at, &data)?))
}

/// The JSON header of a safetensors file's bytes.
fn header(at: &Path, data: &[u8]) -> Result<Value> {
    let bad = || fail(format!("{}: not a safetensors file", at.display()));
    let n = data.get(..8).ok_or_else(bad)?;
    let n = u64::from_le_bytes(n.try_into().map_err(|_| bad())?) as usize;
    let json = data
        .get(8..8usize.checked_add(n).ok_or_else(bad)?)
        .ok_or_else(bad)?;
    serde_json::from_slice(json).map_err(|e| fail(format!("{}: {e}", at.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-file checkpoint in a fresh directory: a safetensors file holding `w` (4 f32) in
    /// blocks of 16 bytes, and its index.
    fn checkpoint(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-verify-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let mut data = (header.len() as u64).to_le_bytes().to_vec();
        data.extend_from_slice(header);
        data.extend((0..4).flat_map(|i| (i as f32).to_le_bytes()));
        let crcs: Vec<u32> = data.chunks(16).map(crc32).collect();
        std::fs::write(dir.join("rank-0.safetensors"), &data).unwrap();
        let index = serde_json::json!({
            "files": [{"name": "rank-0.safetensors", "bytes": data.len(), "block_bytes": 16,
                       "block_crc32": crcs}],
            "tensors": [{"chunks": [{"file": 0, "key": "w"}]}],
        });
        std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
        dir
    }

    #[test]
    fn crc32_of_the_check_string() {
        assert_eq!(super::crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn an_intact_checkpoint_verifies_and_a_flipped_byte_names_its_block() {
        let dir = checkpoint("flip");
        let blocks = verify_checkpoint(&dir).unwrap_or_else(|e| panic!("{}", e.message));
        assert_eq!(blocks, 5, "79 bytes in blocks of 16");
        let file = dir.join("rank-0.safetensors");
        let mut data = std::fs::read(&file).unwrap();
        let last = data.len() - 1;
        data[last] ^= 1;
        std::fs::write(&file, data).unwrap();
        let err = verify_checkpoint(&dir).expect_err("a flipped byte must fail");
        assert!(
            err.message.contains("block 4 (bytes 64.."),
            "{}",
            err.message
        );
        assert!(err.message.contains("corrupted"), "{}", err.message);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

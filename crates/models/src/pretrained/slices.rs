//! A Hugging Face directory's weights read a slice at a time ([`Weights`]): each safetensors
//! header is parsed once, and a region of a tensor reads only its own bytes from the file —
//! what lets every rank load only what its layout holds
//! ([`bonfire_train::checkpoint::load_parameters`]).

use super::weight_files;
use bonfire_parallel::{ParameterSource, Region};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Where one tensor lies: its file, its dtype's bytes per element and decoder, its shape, and
/// the offset of its first byte in the file.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Float,
    shape: Vec<usize>,
    offset: u64,
}

/// The float dtypes a weight file may hold (read into f32 exactly).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Float {
    F32,
    Bf16,
    F16,
}

impl Float {
    fn parse(name: &str) -> Option<Self> {
        match name {
            "F32" => Some(Self::F32),
            "BF16" => Some(Self::Bf16),
            "F16" => Some(Self::F16),
            _ => None,
        }
    }
    fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
    fn decode(self, raw: &[u8], out: &mut Vec<f32>) {
        match self {
            Self::F32 => out.extend(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap())),
            ),
            Self::Bf16 => out.extend(
                raw.chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32()),
            ),
            Self::F16 => out.extend(
                raw.chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32()),
            ),
        }
    }
}

/// The weights of a Hugging Face model directory (`model.safetensors`, or the shards of
/// `model.safetensors.index.json`), their headers read, their data read on demand.
#[derive(Debug)]
pub struct Weights {
    dir: PathBuf,
    files: Vec<(PathBuf, Mutex<File>)>,
    tensors: BTreeMap<String, Entry>,
}

impl Weights {
    /// Opens `dir`'s weight files and reads their headers. `Err` names a missing or malformed
    /// file, a tensor of a dtype other than f32/bf16/f16, or a name in two files.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        for (k, path) in weight_files(dir)?.into_iter().enumerate() {
            let mut file =
                File::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            for (name, entry) in header(&mut file, &path, k)? {
                if tensors.insert(name.clone(), entry).is_some() {
                    return Err(format!(
                        "{}: `{name}` is in two weight files",
                        dir.display()
                    ));
                }
            }
            files.push((path, Mutex::new(file)));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            tensors,
        })
    }

    /// The weights without the tensors `drop` names (a checkpoint's modules the model does
    /// not train: DeepSeek-V3's multi-token prediction).
    pub fn without(mut self, drop: impl Fn(&str) -> bool) -> Self {
        self.tensors.retain(|name, _| !drop(name));
        self
    }
}

/// The tensors a safetensors file's header lists (file number `k`).
fn header(file: &mut File, path: &Path, k: usize) -> Result<Vec<(String, Entry)>, String> {
    let bad = |why: String| format!("{} is not a safetensors file: {why}", path.display());
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| bad(e.to_string()))?;
    let n = u64::from_le_bytes(len);
    let size = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    if n > size.saturating_sub(8) {
        return Err(bad(format!("a header of {n} bytes in a file of {size}")));
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact(&mut text).map_err(|e| bad(e.to_string()))?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::new();
    for (name, info) in header.into_iter().filter(|(n, _)| n != "__metadata__") {
        let field = |f: &str| {
            info.get(f)
                .ok_or_else(|| bad(format!("`{name}` has no {f}")))
        };
        let dtype_name = field("dtype")?.as_str().unwrap_or_default();
        let dtype = Float::parse(dtype_name).ok_or_else(|| {
            format!(
                "{}: tensor `{name}` has dtype {dtype_name}; expected a float",
                path.display()
            )
        })?;
        let numbers = |f: &str| -> Result<Vec<u64>, String> {
            let list = field(f)?
                .as_array()
                .ok_or_else(|| bad(format!("`{name}`: {f}")))?;
            list.iter()
                .map(|v| v.as_u64().ok_or_else(|| bad(format!("`{name}`: {f}"))))
                .collect()
        };
        let shape: Vec<usize> = numbers("shape")?.into_iter().map(|d| d as usize).collect();
        let offsets = numbers("data_offsets")?;
        let bytes = (shape.iter().product::<usize>() * dtype.bytes()) as u64;
        if offsets.len() != 2 || offsets[1] - offsets[0] != bytes || 8 + n + offsets[1] > size {
            return Err(bad(format!(
                "`{name}`: data offsets {offsets:?} for {bytes} bytes"
            )));
        }
        let offset = 8 + n + offsets[0];
        out.push((
            name,
            Entry {
                file: k,
                dtype,
                shape,
                offset,
            },
        ));
    }
    Ok(out)
}

impl Weights {
    /// The names of the tensors in the files.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

impl ParameterSource for Weights {
    fn check(&self, params: &[(String, Vec<usize>)]) -> Result<(), String> {
        let mut problems = Vec::new();
        for (name, shape) in params {
            match self.tensors.get(name) {
                None => problems.push(format!("missing `{name}`")),
                Some(e) if &e.shape != shape => problems.push(format!(
                    "`{name}` is {:?} in the files, {shape:?} in the model",
                    e.shape
                )),
                Some(_) => {}
            }
        }
        let unexpected = self
            .tensors
            .keys()
            .filter(|n| !params.iter().any(|(p, _)| p == *n))
            .map(|n| format!("unexpected `{n}`"));
        problems.extend(unexpected);
        match problems.is_empty() {
            true => Ok(()),
            false => Err(format!("{}: {}", self.dir.display(), problems.join("; "))),
        }
    }

    fn read(&self, name: &str, shape: &[usize], region: &Region) -> Result<Vec<f32>, String> {
        let entry = self
            .tensors
            .get(name)
            .filter(|e| e.shape == shape)
            .ok_or_else(|| {
                format!(
                    "{}: no tensor `{name}` of shape {shape:?}",
                    self.dir.display()
                )
            })?;
        let (path, file) = &self.files[entry.file];
        let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
        let width = entry.dtype.bytes();
        let mut out = Vec::with_capacity(region.len());
        let mut raw = Vec::new();
        for run in region.runs_from(&Region::whole(shape)) {
            raw.resize(run.len * width, 0);
            file.seek(SeekFrom::Start(entry.offset + (run.src * width) as u64))
                .and_then(|_| file.read_exact(&mut raw))
                .map_err(|e| format!("{}: reading `{name}`: {e}", path.display()))?;
            debug_assert_eq!(run.dst, out.len(), "runs come in the region's order");
            entry.dtype.decode(&raw, &mut out);
        }
        match out.len() == region.len() {
            true => Ok(out),
            false => Err(format!(
                "`{name}`: the region {region:?} does not fit {shape:?}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::{Dtype, tensor::TensorView};

    /// A bf16 and an f32 tensor in one file: boxes and flat ranges of them read as the whole
    /// file read does; a missing, misshapen or extra tensor is named.
    #[test]
    fn regions_read_their_own_elements() {
        let dir = std::env::temp_dir().join(format!("bonfire-slices-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<f32> = (0..6).map(|i| i as f32 + 0.25).collect();
        let a16: Vec<u8> = a
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let b32: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
        let views = vec![
            ("a", TensorView::new(Dtype::BF16, vec![4, 6], &a16).unwrap()),
            ("b", TensorView::new(Dtype::F32, vec![6], &b32).unwrap()),
        ];
        safetensors::serialize_to_file(views, None, &dir.join(super::super::WEIGHTS)).unwrap();
        let w = Weights::open(&dir).unwrap();
        // Columns 2..5 of rows 1..3, then elements 1..5 of that box.
        let boxed = Region::of_box(vec![1, 2], vec![2, 3]);
        let want: Vec<f32> = [8, 9, 10, 14, 15, 16].iter().map(|&i| a[i]).collect();
        assert_eq!(w.read("a", &[4, 6], &boxed).unwrap(), want);
        assert_eq!(
            w.read("a", &[4, 6], &boxed.narrow(1..5)).unwrap(),
            want[1..5]
        );
        assert_eq!(
            w.read("b", &[6], &Region::whole(&[6]).narrow(2..6))
                .unwrap(),
            b[2..]
        );
        let params = |names: &[(&str, Vec<usize>)]| -> Vec<(String, Vec<usize>)> {
            names
                .iter()
                .map(|(n, s)| (n.to_string(), s.clone()))
                .collect()
        };
        w.check(&params(&[("a", vec![4, 6]), ("b", vec![6])]))
            .unwrap();
        let err = w
            .check(&params(&[("a", vec![6, 4]), ("c", vec![1])]))
            .unwrap_err();
        for part in [
            "`a` is [4, 6] in the files, [6, 4]",
            "missing `c`",
            "unexpected `b`",
        ] {
            assert!(err.contains(part), "{err}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

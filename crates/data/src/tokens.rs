//! Token files, as nanoGPT and llm.c write them, memory-mapped and checked once.
//!
//! - **Raw** (nanoGPT's `train.bin`): a flat little-endian array of token ids, `u16` when
//!   the vocabulary has at most 65536 tokens, `u32` above (see [`TokenWidth::for_vocab`]).
//! - **llm.c**: a header of 256 little-endian `i32` (1024 bytes): [`LLMC_MAGIC`], the version
//!   (1: `u16` tokens, 2: `u32` tokens), the token count; then the tokens.
//!
//! A file whose first four bytes are llm.c's magic is read as llm.c's; every other file as
//! raw. (A raw `u16` file could start with the ids 55016, 308 — the magic's two halves — only
//! with a vocabulary of more than 55016 tokens; its header would then also have to name a
//! known version and the file's exact token count to be taken for llm.c's.)

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::DataError;

/// The first `i32` of an llm.c token file.
pub const LLMC_MAGIC: i32 = 20240520;
/// The bytes of an llm.c header (256 `i32`), before the tokens.
pub const LLMC_HEADER_BYTES: usize = 1024;

/// The bytes of one token id in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenWidth {
    /// Two bytes: vocabularies of at most 65536 tokens (GPT-2's 50257, …).
    U16,
    /// Four bytes: larger vocabularies (Llama 3's 128256, …).
    U32,
}

impl TokenWidth {
    /// `U16` when every id of a vocabulary of `vocab_size` tokens fits in two bytes
    /// (`vocab_size <= 65536`), `U32` otherwise: what nanoGPT's `prepare.py` scripts write.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenWidth::U16
        } else {
            TokenWidth::U32
        }
    }

    /// Bytes per token: 2 or 4.
    pub fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }

    /// The llm.c header version of this width: 1 for `u16` tokens, 2 for `u32`.
    fn llmc_version(self) -> i32 {
        match self {
            TokenWidth::U16 => 1,
            TokenWidth::U32 => 2,
        }
    }
}

/// How a token file is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenFormat {
    /// nanoGPT's: the ids alone.
    Raw,
    /// llm.c's: the 1024-byte header with magic, version and count, then the ids.
    LlmC,
}

/// A token file, memory-mapped. Opening it checks it once: its length (a whole number of
/// tokens; llm.c's count) and that every id is below the vocabulary size.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    /// The byte offset of the first token (0, or llm.c's header).
    start: usize,
    len: usize,
    width: TokenWidth,
    format: TokenFormat,
}

impl TokenFile {
    /// Opens `path` for a vocabulary of `vocab_size` tokens: an llm.c file (by its magic)
    /// with its header's width, any other file as raw ids of
    /// [`TokenWidth::for_vocab`]`(vocab_size)`. Every id is checked to be below
    /// `vocab_size`; the first that is not is an error naming the file, its position and
    /// the id.
    pub fn open(path: impl AsRef<Path>, vocab_size: usize) -> Result<Self, DataError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| DataError::io(path, "opening", e))?;
        let map = map_read_only(&file, path)?;
        let bad_header = |reason: String| DataError::BadHeader {
            path: path.to_path_buf(),
            reason,
        };
        let header_int = |i: usize| {
            let at = 4 * i;
            map.get(at..at + 4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let (format, width, start) = if header_int(0) == Some(LLMC_MAGIC) {
            if map.len() < LLMC_HEADER_BYTES {
                return Err(bad_header(format!(
                    "the file starts with the magic {LLMC_MAGIC} but has {} bytes, fewer than \
                     the {LLMC_HEADER_BYTES} of the header",
                    map.len()
                )));
            }
            let width = match header_int(1) {
                Some(1) => TokenWidth::U16,
                Some(2) => TokenWidth::U32,
                v => {
                    return Err(bad_header(format!(
                        "version {} is neither 1 (u16 tokens) nor 2 (u32 tokens)",
                        v.unwrap_or_default()
                    )));
                }
            };
            let count = header_int(2).unwrap_or_default();
            let bytes = map.len() - LLMC_HEADER_BYTES;
            if count < 0 || count as usize * width.bytes() != bytes {
                return Err(bad_header(format!(
                    "the header counts {count} tokens but the file holds {bytes} bytes of \
                     {}-byte tokens after the header ({} tokens{})",
                    width.bytes(),
                    bytes / width.bytes(),
                    if !bytes.is_multiple_of(width.bytes()) {
                        " and a partial one"
                    } else {
                        ""
                    }
                )));
            }
            (TokenFormat::LlmC, width, LLMC_HEADER_BYTES)
        } else {
            let width = TokenWidth::for_vocab(vocab_size);
            if map.len() % width.bytes() != 0 {
                return Err(DataError::BadLength {
                    path: path.to_path_buf(),
                    bytes: map.len() as u64,
                    width: width.bytes(),
                });
            }
            (TokenFormat::Raw, width, 0)
        };
        let tokens = TokenFile {
            path: path.to_path_buf(),
            len: (map.len() - start) / width.bytes(),
            map,
            start,
            width,
            format,
        };
        if let Some((position, token)) = tokens
            .iter()
            .enumerate()
            .find(|&(_, t)| t as usize >= vocab_size)
        {
            return Err(DataError::TokenOutOfVocab {
                path: path.to_path_buf(),
                position,
                token,
                vocab_size,
            });
        }
        Ok(tokens)
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the file holds no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The id at `index`.
    ///
    /// # Panics
    /// If `index >= self.len()`.
    pub fn get(&self, index: usize) -> u32 {
        assert!(
            index < self.len,
            "{}: token {index} of {}",
            self.path.display(),
            self.len
        );
        self.decode(self.start + index * self.width.bytes())
    }

    /// The ids in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        (0..self.len).map(move |i| self.decode(self.start + i * self.width.bytes()))
    }

    /// All the ids, copied.
    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes per id in the file.
    pub fn width(&self) -> TokenWidth {
        self.width
    }

    /// Raw or llm.c.
    pub fn format(&self) -> TokenFormat {
        self.format
    }

    fn decode(&self, at: usize) -> u32 {
        let b = &self.map[at..at + self.width.bytes()];
        match self.width {
            TokenWidth::U16 => u32::from(u16::from_le_bytes([b[0], b[1]])),
            TokenWidth::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

/// Maps `file` (opened read-only) into memory.
#[allow(unsafe_code)]
fn map_read_only(file: &File, path: &Path) -> Result<Mmap, DataError> {
    // SAFETY: `Mmap::map` is unsafe because the mapped bytes change if another process
    // modifies or truncates the file while it is mapped (truncation can even fault on
    // access). The file is opened read-only, the mapping is never written through, and a
    // token file is data that is not expected to change while training reads it: it is
    // written once (by nanoGPT's or llm.c's scripts, or by this crate's text cache, which
    // writes a new file and renames it into place, never rewriting a mapped one).
    unsafe { Mmap::map(file) }.map_err(|e| DataError::io(path, "memory-mapping", e))
}

/// The tokens that sequences are packed from: a memory-mapped [`TokenFile`], or ids in
/// memory.
#[derive(Debug)]
pub enum Tokens {
    /// A token file.
    File(TokenFile),
    /// Ids in memory.
    Memory(Vec<u32>),
}

impl Tokens {
    /// The number of tokens.
    pub fn len(&self) -> usize {
        match self {
            Tokens::File(f) => f.len(),
            Tokens::Memory(v) => v.len(),
        }
    }

    /// Whether there is no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id at `index`.
    ///
    /// # Panics
    /// If `index >= self.len()`.
    pub fn get(&self, index: usize) -> u32 {
        match self {
            Tokens::File(f) => f.get(index),
            Tokens::Memory(v) => v[index],
        }
    }

    /// Appends the ids of `range`, as `i64`, to `out`.
    pub(crate) fn extend_i64(&self, range: Range<usize>, out: &mut Vec<i64>) {
        match self {
            Tokens::File(f) => out.extend(range.map(|i| i64::from(f.get(i)))),
            Tokens::Memory(v) => out.extend(v[range].iter().map(|&t| i64::from(t))),
        }
    }
}

impl From<TokenFile> for Tokens {
    fn from(file: TokenFile) -> Self {
        Tokens::File(file)
    }
}

impl From<Vec<u32>> for Tokens {
    fn from(ids: Vec<u32>) -> Self {
        Tokens::Memory(ids)
    }
}

/// Writes a token file as it goes: ids pushed in order, the llm.c count filled in by
/// [`TokenWriter::finish`]. It writes exactly the files [`TokenFile::open`] reads.
pub struct TokenWriter {
    path: PathBuf,
    out: BufWriter<File>,
    width: TokenWidth,
    format: TokenFormat,
    count: usize,
}

impl TokenWriter {
    /// Creates (or truncates) `path`, for ids of `width` in `format`.
    pub fn create(
        path: impl AsRef<Path>,
        width: TokenWidth,
        format: TokenFormat,
    ) -> Result<Self, DataError> {
        let path = path.as_ref().to_path_buf();
        let file = File::create(&path).map_err(|e| DataError::io(&path, "creating", e))?;
        let mut writer = TokenWriter {
            out: BufWriter::new(file),
            path,
            width,
            format,
            count: 0,
        };
        if format == TokenFormat::LlmC {
            // The header, its count 0 until `finish`.
            writer.write_header()?;
        }
        Ok(writer)
    }

    /// Appends `ids`; an id that does not fit the width (a `u16` file's 65536 and above) is
    /// an error naming its position in the file.
    pub fn push(&mut self, ids: &[u32]) -> Result<(), DataError> {
        let mut buf = Vec::with_capacity(ids.len() * self.width.bytes());
        for (i, &id) in ids.iter().enumerate() {
            match self.width {
                TokenWidth::U16 => {
                    let id16 = u16::try_from(id).map_err(|_| DataError::TokenOutOfVocab {
                        path: self.path.clone(),
                        position: self.count + i,
                        token: id,
                        vocab_size: 1 << 16,
                    })?;
                    buf.extend_from_slice(&id16.to_le_bytes());
                }
                TokenWidth::U32 => buf.extend_from_slice(&id.to_le_bytes()),
            }
        }
        self.out
            .write_all(&buf)
            .map_err(|e| DataError::io(&self.path, "writing", e))?;
        self.count += ids.len();
        Ok(())
    }

    /// The ids pushed so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Fills in llm.c's count and flushes the file to disk; returns the number of ids.
    pub fn finish(mut self) -> Result<usize, DataError> {
        if self.format == TokenFormat::LlmC {
            if i32::try_from(self.count).is_err() {
                return Err(DataError::BadHeader {
                    path: self.path.clone(),
                    reason: format!(
                        "{} tokens do not fit the header's i32 count; write a raw file",
                        self.count
                    ),
                });
            }
            self.out
                .seek(SeekFrom::Start(0))
                .map_err(|e| DataError::io(&self.path, "writing", e))?;
            self.write_header()?;
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| DataError::io(&self.path, "writing", e.into_error()))?;
        file.sync_all()
            .map_err(|e| DataError::io(&self.path, "writing", e))?;
        Ok(self.count)
    }

    fn write_header(&mut self) -> Result<(), DataError> {
        let mut header = [0i32; LLMC_HEADER_BYTES / 4];
        header[0] = LLMC_MAGIC;
        header[1] = self.width.llmc_version();
        header[2] = self.count as i32;
        let bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.out
            .write_all(&bytes)
            .map_err(|e| DataError::io(&self.path, "writing", e))
    }
}

/// Writes `ids` to `path` as a token file of `width` in `format` (see [`TokenWriter`]).
pub fn write_tokens(
    path: impl AsRef<Path>,
    ids: &[u32],
    width: TokenWidth,
    format: TokenFormat,
) -> Result<(), DataError> {
    let mut writer = TokenWriter::create(path, width, format)?;
    writer.push(ids)?;
    writer.finish().map(|_| ())
}

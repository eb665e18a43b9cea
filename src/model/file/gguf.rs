//! Opening GGUF files with clear errors, and the tensor sources the loader reads from.
//!
//! [`GgufFile`] checks what `candle_core::quantized::gguf_file` does not: that the path
//! exists, that it is a GGUF file at all, and that every tensor's bytes are really in the
//! file (a truncated download otherwise fails late and obscurely).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file::Content, GgmlDType, QTensor};
use candle_core::Device;

use crate::{Error, Result};

/// Where the loader gets named quantized tensors from.
pub trait TensorSource {
    /// Whether a tensor of this name exists.
    fn has(&self, name: &str) -> bool;
    /// Read one tensor.
    fn tensor(&mut self, name: &str) -> Result<QTensor>;
    /// Read one tensor's bytes as the file stores them, without building a `QTensor`
    /// (which holds a second copy while it is built).
    fn raw(&mut self, name: &str) -> Result<RawTensor> {
        let t = self.tensor(name)?;
        Ok(RawTensor {
            dtype: t.dtype(),
            dims: t.shape().dims().to_vec(),
            bytes: t.data()?.into_owned(),
        })
    }
}

/// A tensor's type, shape (candle's order: the last dimension contiguous) and bytes.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub dtype: GgmlDType,
    pub dims: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// An opened, checked GGUF file.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

const GGUF_MAGIC: &[u8; 4] = b"GGUF";

impl GgufFile {
    /// Open `path`, parse its header and check that the tensor data is complete.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut reader = BufReader::new(file);
        let bad = |reason: String| Error::BadGguf {
            path: path.to_path_buf(),
            reason,
        };
        let content = read_header(&mut reader, len).map_err(bad)?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    /// The parsed header: metadata and tensor directory.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// Drop the `tokenizer.ggml.*` metadata (vocabulary, scores, token types, merges)
    /// once the tokenizer is built from it: for a large vocabulary it is most of the
    /// header (Gemma 3's 262,144 tokens: about 33 MiB), and it would otherwise stay
    /// resident while the weights load.
    pub fn release_tokenizer_metadata(&mut self) {
        self.content
            .metadata
            .retain(|key, _| !key.starts_with("tokenizer.ggml."));
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Parse the GGUF header at the start of `reader`, a file of `len` bytes, and check that
/// every tensor's bytes lie inside it. Nothing is allocated from a count or length before
/// it has been checked against `len`, so a corrupt header is an `Err` (the reason, for
/// [`Error::BadGguf`]), never an abort; this is the function the GGUF fuzz targets drive.
pub fn read_header<R: Read + Seek>(
    reader: &mut R,
    len: u64,
) -> std::result::Result<Content, String> {
    let mut magic = [0u8; 4];
    reader
        .read_exact(&mut magic)
        .map_err(|_| format!("only {len} bytes long"))?;
    if &magic != GGUF_MAGIC {
        return Err("no GGUF magic at the start of the file".into());
    }
    reader.rewind().map_err(|e| e.to_string())?;
    walk_header(reader, len)?;
    reader.rewind().map_err(|e| e.to_string())?;
    let content = Content::read(reader).map_err(|e| format!("unreadable header ({e})"))?;
    for (name, info) in &content.tensor_infos {
        let dtype = info.ggml_dtype;
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("tensor `{name}`: shape {:?} overflows", info.shape.dims()))?;
        if elems % dtype.block_size() != 0 {
            return Err(format!(
                "tensor `{name}`: {elems} elements are not whole blocks of {} ({dtype:?})",
                dtype.block_size()
            ));
        }
        let end = (elems / dtype.block_size())
            .checked_mul(dtype.type_size())
            .and_then(|bytes| u64::try_from(bytes).ok())
            .and_then(|bytes| bytes.checked_add(info.offset))
            .and_then(|rel| rel.checked_add(content.tensor_data_offset));
        match end {
            Some(end) if end <= len => {}
            Some(end) => {
                return Err(format!(
                    "truncated: tensor `{name}` ends at byte {end}, the file has {len}"
                ))
            }
            None => return Err(format!("tensor `{name}`: offset {} overflows", info.offset)),
        }
    }
    Ok(content)
}

/// Deepest nesting of GGUF arrays accepted (real files nest at most once).
const MAX_ARRAY_DEPTH: usize = 4;
/// Most dimensions a GGUF tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u64 = 4;

/// Walks a GGUF header without allocating, so that no count or length read from the
/// file can ask for more memory or more reading than the file holds: every string
/// length, array length and item count is checked against the bytes left before it is
/// trusted. `candle`'s reader, which allocates from those numbers directly, runs only
/// after this walk has passed.
struct HeaderWalk<'r, R> {
    reader: &'r mut R,
    /// Bytes from the current position to the end of the file.
    left: u64,
    /// GGUF version 1 writes counts and lengths as u32, later versions as u64.
    wide: bool,
}

impl<R: Read + Seek> HeaderWalk<'_, R> {
    /// A little-endian unsigned integer of `width` (at most 8) bytes.
    fn uint(&mut self, width: u64, what: &str) -> std::result::Result<u64, String> {
        if self.left < width {
            return Err(format!("ends inside {what}"));
        }
        let mut b = [0u8; 8];
        self.reader
            .read_exact(&mut b[..width as usize])
            .map_err(|e| format!("{what}: {e}"))?;
        self.left -= width;
        Ok(u64::from_le_bytes(b))
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        self.uint(4, what).map(|v| v as u32)
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        self.uint(8, what)
    }

    /// A count or length: u32 in version 1, u64 after.
    fn count(&mut self, what: &str) -> std::result::Result<u64, String> {
        if self.wide {
            self.u64(what)
        } else {
            self.u32(what).map(u64::from)
        }
    }

    /// Skip `n` bytes that must lie inside the file.
    fn skip(&mut self, n: u64, what: &str) -> std::result::Result<(), String> {
        if n > self.left {
            return Err(format!(
                "{what} of {n} bytes runs past the end of the file ({} bytes left)",
                self.left
            ));
        }
        // Short runs (token strings) are read through, which keeps a buffered reader's
        // buffer; long ones are seeked over.
        const READ_THROUGH: u64 = 4096;
        if n <= READ_THROUGH {
            let mut sink = [0u8; READ_THROUGH as usize];
            self.reader
                .read_exact(&mut sink[..n as usize])
                .map_err(|e| format!("{what}: {e}"))?;
        } else {
            let step = i64::try_from(n).map_err(|_| format!("{what}: {n} bytes"))?;
            self.reader
                .seek(SeekFrom::Current(step))
                .map_err(|e| format!("{what}: {e}"))?;
        }
        self.left -= n;
        Ok(())
    }

    /// A count of `n` items of at least `min_bytes` each must fit in what is left.
    fn fits(&self, n: u64, min_bytes: u64, what: &str) -> std::result::Result<(), String> {
        match n.checked_mul(min_bytes) {
            Some(total) if total <= self.left => Ok(()),
            _ => Err(format!(
                "{what} claims {n} entries, more than the {} bytes left can hold",
                self.left
            )),
        }
    }

    /// A string: its length, then that many bytes (not read: only their extent matters
    /// here). Returns the length.
    fn string(&mut self, what: &str) -> std::result::Result<u64, String> {
        let len = self.count(what)?;
        self.skip(len, what)?;
        Ok(len)
    }

    /// The smallest encoding of one value of GGUF type `ty`, or `None` for an unknown
    /// type.
    fn min_size(&self, ty: u32) -> Option<u64> {
        let count = if self.wide { 8 } else { 4 };
        Some(match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => count,
            9 => 4 + count,
            _ => return None,
        })
    }

    /// One metadata value of type `ty`; `depth` counts enclosing arrays.
    fn value(&mut self, ty: u32, depth: usize, what: &str) -> std::result::Result<(), String> {
        let size = self
            .min_size(ty)
            .ok_or_else(|| format!("{what}: unknown value type {ty}"))?;
        match ty {
            8 => self.string(what).map(|_| ()),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!(
                        "{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    ));
                }
                let elem = self.u32(what)?;
                let elem_size = self
                    .min_size(elem)
                    .ok_or_else(|| format!("{what}: unknown array element type {elem}"))?;
                let n = self.count(what)?;
                self.fits(n, elem_size, what)?;
                if matches!(elem, 8 | 9) {
                    for _ in 0..n {
                        self.value(elem, depth + 1, what)?;
                    }
                    Ok(())
                } else {
                    self.skip(n * elem_size, what)
                }
            }
            _ => self.skip(size, what),
        }
    }
}

/// Check a GGUF header, starting at the current position of `reader` (the file's
/// start) in a file of `len` bytes: version, counts, lengths, value types, tensor ranks
/// and `general.alignment`. Errors are the reason only, for [`Error::BadGguf`].
fn walk_header<R: Read + Seek>(reader: &mut R, len: u64) -> std::result::Result<(), String> {
    let mut walk = HeaderWalk {
        reader,
        left: len,
        wide: true,
    };
    walk.u32("the magic")?;
    let version = walk.u32("the version")?;
    walk.wide = match version {
        1 => false,
        2 | 3 => true,
        v => return Err(format!("GGUF version {v} (readable: 1, 2 and 3)")),
    };
    let n_tensors = walk.count("the tensor count")?;
    let n_keys = walk.count("the metadata key count")?;
    let count = if walk.wide { 8 } else { 4 };
    // The smallest key is an empty name, a type and one byte; the smallest tensor entry
    // an empty name, a rank of 0, a type and an offset.
    walk.fits(n_keys, count + 4 + 1, "the metadata")?;
    walk.fits(n_tensors, count + 4 + 4 + 8, "the tensor directory")?;
    for i in 0..n_keys {
        let what = format!("metadata key {i}");
        let key_len = walk.count(&what)?;
        // Keys are read only as far as needed to recognise `general.alignment`, which
        // divides the data offset: candle's reader would divide by a 0 there.
        const ALIGNMENT: &[u8; 17] = b"general.alignment";
        let is_alignment = if key_len == ALIGNMENT.len() as u64 {
            let mut name = [0u8; 17];
            for b in name.iter_mut() {
                *b = walk.uint(1, &what)? as u8;
            }
            &name == ALIGNMENT
        } else {
            walk.skip(key_len, &what)?;
            false
        };
        let ty = walk.u32(&what)?;
        if is_alignment && matches!(ty, 0..=5) {
            let width = walk.min_size(ty).unwrap_or(4);
            if walk.uint(width, &what)? == 0 {
                return Err("general.alignment is 0".into());
            }
        } else {
            walk.value(ty, 0, &what)?;
        }
    }
    for i in 0..n_tensors {
        let what = format!("tensor entry {i}");
        walk.string(&what)?;
        let rank = walk.u32(&what)?;
        if u64::from(rank) > MAX_DIMS {
            return Err(format!("{what}: {rank} dimensions (at most {MAX_DIMS})"));
        }
        let dim = if walk.wide { 8 } else { 4 };
        walk.skip(u64::from(rank) * dim, &what)?;
        walk.skip(4 + 8, &what)?;
    }
    Ok(())
}

impl TensorSource for GgufFile {
    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has(name) {
            return Err(Error::Tensor {
                name: name.to_string(),
                reason: "missing from the file".into(),
            });
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| Error::Tensor {
                name: name.to_string(),
                reason: e.to_string(),
            })
    }

    fn raw(&mut self, name: &str) -> Result<RawTensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::Tensor {
                name: name.to_string(),
                reason: "missing from the file".into(),
            })?;
        let (dtype, dims) = (info.ggml_dtype, info.shape.dims().to_vec());
        // `open` checked that these bytes lie inside the file.
        let len = dims.iter().product::<usize>() / dtype.block_size() * dtype.type_size();
        let start = self.content.tensor_data_offset + info.offset;
        let mut bytes = vec![0u8; len];
        self.reader
            .seek(SeekFrom::Start(start))
            .and_then(|_| self.reader.read_exact(&mut bytes))
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(RawTensor { dtype, dims, bytes })
    }
}

/// Tensors held in memory, e.g. the random weights of a test model.
#[derive(Default)]
pub struct MemorySource {
    tensors: HashMap<String, QTensor>,
}

impl MemorySource {
    /// Add (or replace) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: QTensor) {
        self.tensors.insert(name.into(), tensor);
    }
}

impl TensorSource for MemorySource {
    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn tensor(&mut self, name: &str) -> Result<QTensor> {
        self.tensors.remove(name).ok_or_else(|| Error::Tensor {
            name: name.to_string(),
            reason: "missing".into(),
        })
    }
}

/// A model's identity as written into every file headwise produces.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ModelId {
    /// File stem, e.g. `SmolLM2-135M-Instruct.Q4_1`.
    pub name: String,
    /// Hex sha256 of the model file.
    pub sha256: String,
}

impl ModelId {
    /// Hash the file at `path`.
    pub fn of_file(path: &Path) -> Result<Self> {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Self {
            name,
            sha256: sha256_file(path)?,
        })
    }
}

/// Hex sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{self, Value};
    use std::io::Cursor;

    /// A version-1 header (u32 counts and lengths) with no tensors and the given
    /// `(key, type, value bytes)` entries, written byte by byte.
    fn v1(entries: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(1u32.to_le_bytes());
        b.extend(0u32.to_le_bytes());
        b.extend((entries.len() as u32).to_le_bytes());
        for (key, ty, value) in entries {
            b.extend((key.len() as u32).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        b
    }

    fn read(bytes: &[u8]) -> std::result::Result<Content, String> {
        read_header(&mut Cursor::new(bytes), bytes.len() as u64)
    }

    #[test]
    fn version_1_headers_are_walked_with_32_bit_counts() {
        let mut string = 5u32.to_le_bytes().to_vec();
        string.extend(b"llama");
        let ok = v1(&[
            ("general.architecture", 8, string),
            ("llama.block_count", 4, 30u32.to_le_bytes().to_vec()),
        ]);
        let content = read(&ok).unwrap();
        assert_eq!(content.metadata.len(), 2);
        // A string length past the end, in the 32-bit field of version 1.
        let bad = v1(&[("general.name", 8, u32::MAX.to_le_bytes().to_vec())]);
        assert!(read(&bad).unwrap_err().contains("runs past the end"));
        // An array of 2^31 u64s claimed in 40 bytes.
        let mut array = 10u32.to_le_bytes().to_vec();
        array.extend((1u32 << 31).to_le_bytes());
        let bad = v1(&[("x", 9, array)]);
        assert!(read(&bad)
            .unwrap_err()
            .contains("claims 2147483648 entries"));
    }

    #[test]
    fn a_zero_alignment_and_unknown_types_are_refused_before_candle_reads_them() {
        let t = QTensor::quantize(
            &candle_core::Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
            candle_core::quantized::GgmlDType::F32,
        )
        .unwrap();
        let write = |alignment: Value| {
            let mut c = Cursor::new(Vec::new());
            gguf_file::write(&mut c, &[("general.alignment", &alignment)], &[("t", &t)]).unwrap();
            c.into_inner()
        };
        // candle writes with the default alignment of 32 and reads back whatever the key
        // says: 0 would divide by zero there.
        for zero in [Value::U8(0), Value::U16(0), Value::U32(0), Value::I32(0)] {
            let err = read(&write(zero)).unwrap_err();
            assert_eq!(err, "general.alignment is 0");
        }
        assert!(read(&write(Value::U32(32))).is_ok());
        let bad = v1(&[("x", 13, vec![0; 8])]);
        assert!(read(&bad).unwrap_err().contains("unknown value type 13"));
    }

    #[test]
    fn tensor_extents_are_checked_without_overflow() {
        let t = QTensor::quantize(
            &candle_core::Tensor::zeros((2, 32), candle_core::DType::F32, &Device::Cpu).unwrap(),
            candle_core::quantized::GgmlDType::F32,
        )
        .unwrap();
        let mut c = Cursor::new(Vec::new());
        gguf_file::write(&mut c, &[], &[("t", &t)]).unwrap();
        let data = c.into_inner();
        assert!(read(&data).is_ok());
        // The tensor entry: name (8 + 1), rank (4), dims (2 x 8), type (4), offset (8).
        let offset_at = 24 + 9 + 4 + 16 + 4;
        let mut far = data.clone();
        far[offset_at..offset_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read(&far).unwrap_err().contains("overflows"));
        let mut wide = data.clone();
        wide[24 + 9 + 4..24 + 9 + 12].copy_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(read(&wide).unwrap_err().contains("overflows"));
        // Cut anywhere, the file is refused, never read past its end.
        for n in 0..data.len() {
            assert!(read(&data[..n]).is_err(), "cut at {n}");
        }
    }
}

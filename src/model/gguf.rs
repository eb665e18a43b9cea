//! Opening GGUF files with clear errors, and the tensor sources the loader reads from.
//!
//! [`GgufFile`] checks what `candle_core::quantized::gguf_file` does not: that the path
//! exists, that it is a GGUF file at all, and that every tensor's bytes are really in the
//! file (a truncated download otherwise fails late and obscurely).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file::Content, QTensor};
use candle_core::Device;

use crate::{Error, Result};

/// Where the loader gets named quantized tensors from.
pub trait TensorSource {
    /// Whether a tensor of this name exists.
    fn has(&self, name: &str) -> bool;
    /// Read one tensor.
    fn tensor(&mut self, name: &str) -> Result<QTensor>;
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
        let mut magic = [0u8; 4];
        reader
            .read_exact(&mut magic)
            .map_err(|_| bad(format!("only {len} bytes long")))?;
        if &magic != GGUF_MAGIC {
            return Err(bad("no GGUF magic at the start of the file".into()));
        }
        std::io::Seek::rewind(&mut reader).map_err(|e| Error::io(path, e))?;
        let content =
            Content::read(&mut reader).map_err(|e| bad(format!("unreadable header ({e})")))?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            let bytes = elems / block * info.ggml_dtype.type_size();
            let end = content.tensor_data_offset + info.offset + bytes as u64;
            if end > len {
                return Err(bad(format!(
                    "truncated: tensor `{name}` ends at byte {end}, the file has {len}"
                )));
            }
        }
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

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
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

//! Tensor sources: memory-mapped safetensors checkpoints (single file or sharded with
//! `model.safetensors.index.json`) and in-memory tensor maps.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};
use safetensors::SafeTensors;

use crate::error::{DraftError, Result};

/// Values of one tensor as stored.
#[derive(Clone, Debug)]
pub enum TensorData {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// IEEE binary16 bit patterns.
    F16(Vec<u16>),
}

impl TensorData {
    /// Decode to f32 (exact for every stored dtype).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            TensorData::F32(v) => v.clone(),
            TensorData::Bf16(b) => {
                let mut out = vec![0.0; b.len()];
                dflash_quant::decode_bf16(b, &mut out);
                out
            }
            TensorData::F16(b) => {
                let mut out = vec![0.0; b.len()];
                dflash_quant::decode_f16(b, &mut out);
                out
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::Bf16(b) | TensorData::F16(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where the loader reads tensors from.
pub trait TensorSource {
    /// All tensor names, as stored.
    fn names(&self) -> Vec<String>;
    /// The shape of a tensor, or `None` if absent.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// The values of a tensor (an error if absent or not a float tensor).
    fn read(&self, name: &str) -> Result<TensorData>;
}

/// An in-memory tensor map: name -> (shape, f32 values).
pub type TensorMap = HashMap<String, (Vec<usize>, Vec<f32>)>;

impl TensorSource for TensorMap {
    fn names(&self) -> Vec<String> {
        self.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.get(name).map(|(s, _)| s.clone())
    }

    fn read(&self, name: &str) -> Result<TensorData> {
        let (shape, v) = self
            .get(name)
            .ok_or_else(|| DraftError::MissingTensor(name.into()))?;
        let n: usize = shape.iter().product();
        if n != v.len() {
            return Err(DraftError::Invalid(format!(
                "tensor `{name}`: shape {shape:?} holds {n} values, the map holds {}",
                v.len()
            )));
        }
        Ok(TensorData::F32(v.clone()))
    }
}

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    metadata: Metadata,
}

/// A memory-mapped safetensors checkpoint (one file or shards listed by an index).
pub struct SafetensorsCheckpoint {
    shards: Vec<Shard>,
    /// tensor name -> shard index
    names: BTreeMap<String, usize>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DraftError + '_ {
    move |source| DraftError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl SafetensorsCheckpoint {
    /// Open `dir/model.safetensors`, or the shards of `dir/model.safetensors.index.json`,
    /// or a single `.safetensors` file path.
    pub fn open(path: &Path) -> Result<Self> {
        if path.is_file() {
            return Self::from_files(&[path.to_path_buf()]);
        }
        let single = path.join("model.safetensors");
        if single.is_file() {
            return Self::from_files(&[single]);
        }
        let index = path.join("model.safetensors.index.json");
        if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: BTreeMap<String, String>,
            }
            let idx: Index = serde_json::from_str(&text).map_err(|source| DraftError::Json {
                path: index.clone(),
                source,
            })?;
            let mut files: Vec<String> = idx.weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            let paths: Vec<PathBuf> = files.iter().map(|f| path.join(f)).collect();
            let ck = Self::from_files(&paths)?;
            // Every tensor the index lists must be in the shard it names.
            for (name, file) in &idx.weight_map {
                let want = path.join(file);
                match ck.names.get(name) {
                    Some(&i) if ck.shards[i].path == want => {}
                    Some(&i) => {
                        return Err(DraftError::Safetensors {
                            path: index.clone(),
                            msg: format!(
                                "tensor `{name}` is listed in {} but found in {}",
                                want.display(),
                                ck.shards[i].path.display()
                            ),
                        })
                    }
                    None => return Err(DraftError::MissingTensor(name.clone())),
                }
            }
            return Ok(ck);
        }
        Err(DraftError::Io {
            path: single,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "neither model.safetensors nor model.safetensors.index.json found",
            ),
        })
    }

    /// Map and index the given files.
    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut names = BTreeMap::new();
        for (si, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(io_err(path))?;
            // SAFETY: the file is mapped read-only; checkpoints are not modified while loaded
            // (the same contract as every safetensors loader that mmaps).
            let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
            let (n, metadata) =
                SafeTensors::read_metadata(&mmap).map_err(|e| DraftError::Safetensors {
                    path: path.clone(),
                    msg: e.to_string(),
                })?;
            for name in metadata.tensors().keys() {
                if names.insert(name.clone(), si).is_some() {
                    return Err(DraftError::Safetensors {
                        path: path.clone(),
                        msg: format!("tensor `{name}` appears in more than one shard"),
                    });
                }
            }
            shards.push(Shard {
                path: path.clone(),
                mmap,
                data_start: 8 + n,
                metadata,
            });
        }
        Ok(SafetensorsCheckpoint { shards, names })
    }
}

impl TensorSource for SafetensorsCheckpoint {
    fn names(&self) -> Vec<String> {
        self.names.keys().cloned().collect()
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let s = &self.shards[*self.names.get(name)?];
        s.metadata.info(name).map(|i| i.shape.clone())
    }

    fn read(&self, name: &str) -> Result<TensorData> {
        let si = *self
            .names
            .get(name)
            .ok_or_else(|| DraftError::MissingTensor(name.into()))?;
        let s = &self.shards[si];
        let info = s
            .metadata
            .info(name)
            .ok_or_else(|| DraftError::MissingTensor(name.into()))?;
        let (a, b) = info.data_offsets;
        // read_metadata validated the offsets against the buffer length.
        let bytes = s
            .mmap
            .get(s.data_start + a..s.data_start + b)
            .ok_or_else(|| DraftError::Safetensors {
                path: s.path.clone(),
                msg: format!("tensor `{name}`: data offsets {a}..{b} outside the file"),
            })?;
        let n: usize = info.shape.iter().product();
        let u16s = |bytes: &[u8]| -> Vec<u16> {
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let data = match info.dtype {
            Dtype::F32 => TensorData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            Dtype::BF16 => TensorData::Bf16(u16s(bytes)),
            Dtype::F16 => TensorData::F16(u16s(bytes)),
            other => {
                return Err(DraftError::Dtype {
                    tensor: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if data.len() != n {
            return Err(DraftError::Safetensors {
                path: s.path.clone(),
                msg: format!(
                    "tensor `{name}`: shape {:?} needs {n} values, data holds {}",
                    info.shape,
                    data.len()
                ),
            });
        }
        Ok(data)
    }
}

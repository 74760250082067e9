//! HF checkpoint directories: `config.json` + `model.safetensors` or shards with
//! `model.safetensors.index.json`, memory-mapped.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use dflash_backend::{HostData, HostWeight, WeightFormat};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::{Result, TargetError};

struct Shard {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
}

struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A memory-mapped HF checkpoint.
pub struct Checkpoint {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<Shard>,
    entries: BTreeMap<String, Entry>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TargetError + '_ {
    move |source| TargetError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Checkpoint {
    /// Open `dir`: parse `config.json`, map every shard, index every tensor.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| TargetError::Config {
                path: cfg_path.display().to_string(),
                msg: e.to_string(),
            })?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TargetError::Config {
                    path: index.display().to_string(),
                    msg: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| TargetError::Config {
                    path: index.display().to_string(),
                    msg: "missing `weight_map` object".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            return Err(TargetError::Io {
                path: single.display().to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "neither model.safetensors nor model.safetensors.index.json exists",
                ),
            });
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut entries = BTreeMap::new();
        for (si, path) in files.into_iter().enumerate() {
            let file = std::fs::File::open(&path).map_err(io_err(&path))?;
            // SAFETY: the file is opened read-only and the map is only read; a checkpoint
            // changed under us while loading is outside what we defend against.
            let map = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
            let (n, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| TargetError::SafeTensors {
                    path: path.display().to_string(),
                    msg: e.to_string(),
                })?;
            let data_start = 8 + n;
            let infos: HashMap<String, &safetensors::tensor::TensorInfo> = meta.tensors();
            for (name, info) in infos {
                entries.insert(
                    name.clone(),
                    Entry {
                        shard: si,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: info.data_offsets.0,
                        end: info.data_offsets.1,
                    },
                );
            }
            shards.push(Shard {
                path,
                map,
                data_start,
            });
        }
        Ok(Checkpoint {
            dir,
            config,
            shards,
            entries,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of `config.json` (for error messages).
    pub fn config_path(&self) -> String {
        self.dir.join("config.json").display().to_string()
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether `name` exists.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Shape of `name`.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.entry(name)?.shape)
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries
            .get(name)
            .ok_or_else(|| TargetError::MissingTensor { name: name.into() })
    }

    fn bytes(&self, e: &Entry) -> &[u8] {
        let s = &self.shards[e.shard];
        &s.map[s.data_start + e.start..s.data_start + e.end]
    }

    fn check_shape(&self, name: &str, expected: &[usize]) -> Result<&Entry> {
        let e = self.entry(name)?;
        if e.shape != expected {
            return Err(TargetError::Shape {
                name: name.into(),
                expected: expected.to_vec(),
                found: e.shape.clone(),
            });
        }
        Ok(e)
    }

    /// Values of `name` as f32 (f32, bf16 and f16 tensors), checking the shape.
    pub fn f32s(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let e = self.check_shape(name, shape)?;
        let bytes = self.bytes(e);
        let dtype_err = |_| TargetError::Dtype {
            name: name.into(),
            dtype: format!("{:?} (bad length)", e.dtype),
        };
        match e.dtype {
            Dtype::F32 => Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            Dtype::BF16 => dflash_quant::bf16_bytes_to_f32(bytes).map_err(dtype_err),
            Dtype::F16 => dflash_quant::f16_bytes_to_f32(bytes).map_err(dtype_err),
            other => Err(TargetError::Dtype {
                name: name.into(),
                dtype: format!("{other:?}"),
            }),
        }
    }

    /// A 2-D weight `[rows, cols]` in its file format (f32 / bf16 / f16), or re-encoded into
    /// `precision` when one is given.
    pub fn weight(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        precision: Option<WeightFormat>,
    ) -> Result<HostWeight> {
        let e = self.check_shape(name, &[rows, cols])?;
        let file_fmt = match e.dtype {
            Dtype::F32 => WeightFormat::F32,
            Dtype::BF16 => WeightFormat::Bf16,
            Dtype::F16 => WeightFormat::F16,
            other => {
                return Err(TargetError::Dtype {
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        match precision {
            Some(p) if p != file_fmt => {
                let v = self.f32s(name, &[rows, cols])?;
                Ok(HostWeight::from_f32(name, rows, cols, &v, p)?)
            }
            _ => {
                let bytes = self.bytes(e);
                let data = match file_fmt {
                    WeightFormat::F32 => HostData::F32(
                        bytes
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect(),
                    ),
                    WeightFormat::Bf16 => HostData::Bf16(
                        bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]))
                            .collect(),
                    ),
                    _ => HostData::F16(
                        bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]))
                            .collect(),
                    ),
                };
                Ok(HostWeight::new(name, rows, cols, data)?)
            }
        }
    }

    /// Shard file paths (diagnostics).
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }
}

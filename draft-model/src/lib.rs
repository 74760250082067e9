//! The DFlash / DSpark drafter, generic over [`dflash_backend::Backend`].
//!
//! * [`config`]: `config.json` through serde (z-lab, DeepSpec, SpecForge schemas).
//! * [`rope`]: default / linear / llama3 / YaRN rotary parameters, as transformers computes them.
//! * [`checkpoint`]: memory-mapped safetensors (single or sharded) and in-memory tensor maps.
//! * [`model`]: the precision policy, the census gate, shape checks, [`Drafter`].

pub mod checkpoint;
pub mod config;
mod error;
pub mod forward;
pub mod model;
#[cfg(feature = "random")]
pub mod random;
pub mod rope;

pub use checkpoint::{SafetensorsCheckpoint, TensorData, TensorMap, TensorSource};
pub use config::{default_target_layer_ids, DraftConfig, DsparkConfig, LayerKind, RowLayout};
pub use dflash_kv::{DraftKv, KvShape};
pub use error::{DraftError, Result};
pub use forward::{DraftOptions, DraftOutput, FullForward, LentWeights, TargetLend, INGEST_CHUNK};
pub use model::{canonical_name, Drafter, LoadOptions, Precision, WeightRole};
pub use rope::{RopeConfig, RopeScaling};

//! The DFlash / DSpark drafter, generic over [`dflash_backend::Backend`].
//!
//! * [`config`]: `config.json` through serde (z-lab, DeepSpec, SpecForge schemas).
//! * [`rope`]: default / linear / llama3 / YaRN rotary parameters, as transformers computes them.
//! * [`checkpoint`]: memory-mapped safetensors (single or sharded) and in-memory tensor maps.
//! * [`model`]: the precision policy, the census gate, shape checks, [`Drafter`].
//! * [`forward`]: context features, chunked ingest into the draft KV cache, the cached block
//!   forward, the uncached forward, lm_head rows, the Markov chain, the confidence head.
//! * `random` (feature `random`): random tiny drafters for other crates' tests.
//!
//! A round, as the engine drives it (greedy):
//!
//! ```no_run
//! # use dflash_backend::cpu::Cpu;
//! # use dflash_draft_model::*;
//! # fn demo(lend: &dyn TargetLend<Cpu>, taps: &Vec<f32>, prompt_len: usize, last: u32)
//! #     -> Result<()> {
//! let be = Cpu::new();
//! let dr = Drafter::load(&be, "models/draft".as_ref(), &LoadOptions::default())?;
//! let mut kv = dr.new_kv(&be, 4096)?; // context positions the cache can hold
//! // taps: [prompt_len, n_taps * hidden] target states of the committed prompt rows
//! dr.ingest(&be, &mut kv, taps, prompt_len, 0)?;
//! // invariant: kv.len() == the position of the anchor (the last committed token)
//! let out = dr.draft(&be, &mut kv, lend, last, prompt_len, &DraftOptions::default())?;
//! // out.tokens: drafts for positions prompt_len + 1 ..; verify them with the target, then
//! // ingest the target taps of the committed rows (anchor + accepted drafts) at prompt_len.
//! # let _ = out; Ok(()) }
//! ```

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

//! The target-agnostic DFlash / DSpark round engine.
//!
//! One round (greedy): `block = [last, drafts]`, the target verifies `vt` rows with taps,
//! the longest prefix `m` of drafts equal to the target's own argmax is accepted, `m + 1`
//! rows are committed (each target rolls back the rest its own way), the kept rows' taps
//! go into the drafter's context cache and `last` becomes the target's argmax at row `m`.
//! The committed stream is the target's greedy stream by construction; the tests check it
//! token for token against [`plain_greedy`].

mod config;
mod dflash;
mod drafter;
mod engine;
mod error;
mod target;

pub use config::{SpecConfig, Stats, StopReason};
pub use dflash::{DflashDrafter, TargetAsLend};
pub use drafter::{DraftOptions, Drafter};
pub use engine::{generate, plain_greedy, Session, INGEST_CHUNK};
pub use error::{Result, SpecError};
pub use target::{Forward, RollbackArm, Target, TargetInfo};

//! The target-agnostic DFlash / DSpark round engine.
//!
//! One round (greedy): `block = [last, drafts]`, the target verifies `vt` rows with taps,
//! the longest prefix `m` of drafts equal to the target's own argmax is accepted, `m + 1`
//! rows are committed (each target rolls back the rest its own way), the kept rows' taps
//! go into the drafter's context cache and `last` becomes the target's argmax at row `m`.
//! The committed stream is the target's greedy stream by construction; the tests check it
//! token for token against [`plain_greedy`].
//!
//! Pieces:
//! * [`Target`]: the object-safe seam a target model implements (prime with taps, verify a
//!   block, commit a prefix = its own rollback, lend embedding rows and the lm_head);
//!   `dflash-targets` has Qwen3 dense and the Qwen3.5 / Qwen3-Next hybrid.
//! * [`Drafter`]: what the engine needs from a drafter; [`DflashDrafter`] wraps the DFlash /
//!   DSpark drafter of `dflash-draft-model` with its draft KV cache, and [`TargetAsLend`]
//!   hands any `dyn Target` to it as its `TargetLend`.
//! * [`Session`]: prime once, then [`Session::burst`] rounds until at least `n` tokens are
//!   ready (overshoot stays queued), EOS or the context cap; [`generate`] is one session run
//!   to a token budget. [`SpecConfig`] configures it, [`Stats`] reports rounds, drafted,
//!   accepted, tau and per-phase wall time.
//! * [`plain_greedy`]: the reference decode through the same `Target` trait.
//!
//! On the CPU backend with more than one thread, drive the session from inside the backend's
//! pool (`Cpu::run(|| ...)` of `dflash-backend`): its ops then fork in place instead of each
//! being handed to the pool from outside, which costs more than a second core gives at small
//! shapes.

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

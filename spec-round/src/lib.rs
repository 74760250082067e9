//! The target-agnostic DFlash / DSpark round engine.

mod error;
mod target;

pub use error::{Result, SpecError};
pub use target::{Forward, RollbackArm, Target, TargetInfo};

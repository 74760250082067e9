//! The Qwen3.5 / Qwen3-Next hybrid target: Gated DeltaNet linear-attention layers (short
//! causal conv, gated delta rule) interleaved with gated full-attention layers, exactly as
//! transformers 5.17 implements `Qwen3_5ForCausalLM`, the text part of
//! `Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForCausalLM` and `Qwen3NextForCausalLM`
//! (dense SwiGLU MLP, or the sparse MoE block: softmax top-k router, routed SwiGLU experts,
//! a sigmoid-gated shared expert).
//!
//! Load-time transformations (all exact):
//! * zero-centred RMSNorms (`x̂ · (1 + w)`: input, post-attention, final, q_norm, k_norm) get
//!   the `1 + w` folded into the weight; the Gated DeltaNet output norm is a plain `w`;
//! * the full-attention `q_proj` (per head: query then output gate) is split into a query
//!   and a gate projection;
//! * Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba`, interleaved per key head, are split
//!   into the separate q·k·v, z, b and a projections of the Qwen3.5 layout.
//!
//! Rotary embedding: partial (`partial_rotary_factor`, default 0.25), NeoX rotate-half. The
//! vision-language configs carry an interleaved M-RoPE section; for text-only positions
//! its three axes are equal and it reduces to the plain rotary used here.
//!
//! MoE experts load from the published per-expert tensors (`mlp.experts.{e}.*_proj`) or from
//! transformers' fused in-memory layout (`mlp.experts.gate_up_proj` / `down_proj`). The router
//! runs on the host, one row at a time, so routing never depends on the other rows of a call.
//!
//! Not supported (an error at load): attention biases, activations other than SiLU, layer
//! types other than linear / full attention.
//!
//! Rollback ([`dflash_spec_round::RollbackArm`]): `Stash` keeps the conv and recurrent state
//! after every verified token and restores the one after the last kept row; `Replay`
//! snapshots the states before the verify, restores them and re-runs the kept rows through
//! the layers up to the last linear-attention layer; `Gate` does both and errors on any bit
//! that differs (linear states and the re-written K/V rows). Full-attention K/V roll back by
//! truncation in every arm.

mod config;
mod model;
mod weights;

pub use config::{HybridArch, HybridConfig, LayerKind, MoeConfig};
pub use model::HybridTarget;
pub use weights::{HostTensors, TensorNames, TensorSource};

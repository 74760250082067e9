//! `cargo xtask bench gpu`: the DFlash draft step on the CUDA backend (bf16, q8_0, q4_0
//! weights) side by side with a PyTorch bf16 implementation of the same step, the HBM floor
//! from the copy bandwidth measured in the same run, and verify16-vs-decode1 of a dense
//! Qwen3-8B-shaped target.
//!
//! The step is built here directly from the backend's ops in the drafter's structure
//! (embedding -> L Qwen3-style layers over the cached ctx K/V -> final norm -> lm_head on rows
//! 1..b-1 -> argmax), with device-side ids and argmax so the whole step can be captured as
//! one CUDA graph and replayed. Weights are random, generated on the device.
//! Built on the development machine, run on the GPU machine (`.gpu/xtask bench gpu`); the
//! PyTorch side is `tools/bench/torch_drafter.py`, found relative to the working directory.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use dflash_backend::{
    AttnOp, AttnParams, Backend, KvCacheRows, KvStorage, LayerTail, QkNormRope, RopeSpec,
    TailScratch, Weight, WeightFormat,
};
use dflash_cuda_kernels::registry::{SMEM_CARVEOUT_A8, SMEM_CARVEOUT_OTHER};
use dflash_cuda_kernels::{
    A8Act, A8Kernel, AttnFa, AttnKernel, Cuda, CudaBuf, PrefillPrecision, SKINNY_ROWS,
};

mod hybrid;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Context lengths (tokens already in the draft KV cache).
    #[arg(long, default_value = "512,8192")]
    ctx: String,
    /// Shapes: 8b (Qwen3-8B-DFlash-b16), 27b (Qwen3.6-27B-DFlash).
    #[arg(long, default_value = "8b,27b")]
    shapes: String,
    /// Drafter weight formats; `+fa` after one = its attention through `attention_fast`
    /// (1xTF32 / f16 products) instead of the exact op, `+fa16` = through
    /// `attention_fast_kv16` over f16 K / V caches (the CUDA drafter's default).
    #[arg(
        long,
        default_value = "bf16,q8_0,q8_0a8,q8_0a8+fa,q8_0a8+fa16,q4_0,q4_0a8+fa16"
    )]
    formats: String,
    /// Timed replays per measurement (median reported).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Skip the PyTorch peer.
    #[arg(long)]
    no_torch: bool,
    /// Skip the dense-target verify/decode table.
    #[arg(long)]
    no_target: bool,
    /// Weight formats of the dense target in the verify/decode table (bf16 = the checkpoint
    /// as published; q8_0a8 / q4_0a8 = what `--target-precision` re-encodes it to); `+kv16`
    /// after one: its K / V cache in f16 (`--target-kv f16`).
    #[arg(long, default_value = "bf16,bf16+kv16")]
    target_formats: String,
    /// Instead of the dense target's table: at each context and target format, one eager
    /// decode1 and one verify16, each between `cuProfilerStart` and `cuProfilerStop` after an
    /// unprofiled one (for `ncu --profile-from-start off`: those calls' kernels alone); then
    /// exit.
    #[arg(long)]
    profile_target: bool,
    /// Only the per-block trace (as --trace; kernels compiled with `CudaOptions::block_trace`)
    /// of the dense target's decode1 and verify16 graphs at each --target-formats entry and
    /// --ctx, with --trace-layers layers of the Qwen3-8B shape, written as CSV to this file
    /// (its shape column: `FORMAT decode1` / `FORMAT verify16`). Then exit.
    #[arg(long)]
    trace_target: Option<PathBuf>,
    /// Layers of the dense target for --trace-target (the whole 36 overflow the trace buffer).
    #[arg(long, default_value_t = 4)]
    trace_layers: usize,
    /// Only the registers and local memory (spills) per thread of every kernel whose entry
    /// point contains this string ("" for all), as this device's driver compiled them; then
    /// exit. The driver's compiler, not only the source, sets them (and with them how many
    /// blocks an SM holds).
    #[arg(long)]
    kernel_info: Option<String>,
    /// Also time the DSpark variant (Markov head, rank 256) of each drafter.
    #[arg(long)]
    markov: bool,
    /// The Markov chain over bf16 / q8_0 / q4_0 W2 with the lane-contiguous CUDA-core step
    /// kernels instead of the tensor-core one (`Cuda::set_markov_mma(false)`).
    #[arg(long)]
    markov_lanes: bool,
    /// Skip the per-op breakdown (profiling runs).
    #[arg(long)]
    no_ops: bool,
    /// Q8_0A8 matmul kernel for the step: auto (the library default), whole, splitWxKSsS, e.g.
    /// split4x2s3 (K split over the warps of a block: W tiles x KS slices, S pipeline stages),
    /// apartWxKSsS (the same, K also split across blocks) (same bits; a benchmark knob).
    #[arg(long, default_value = "auto")]
    a8_kernel: String,
    /// Q8_0A8 launches with programmatic dependent launch: on (the library default) or off
    /// (same bits; a benchmark knob).
    #[arg(long, default_value = "on")]
    a8_pdl: String,
    /// The tensor-core skinny matmuls (bf16 / q8_0 / q4_0 weights: the targets' decode and
    /// verify) with programmatic dependent launch: on (the library default) or off (same bits;
    /// `Cuda::set_skinny_pdl`).
    #[arg(long, default_value = "on")]
    skinny_pdl: String,
    /// Gate / up and the SiLU product of the skinny matmuls' MLPs in one launch: on (the
    /// library default) or off (same bits; `Cuda::set_skinny_glu`).
    #[arg(long, default_value = "on")]
    skinny_glu: String,
    /// Keys per split of the attention kernel (backend default 256; a benchmark knob).
    #[arg(long)]
    attn_split: Option<usize>,
    /// The causal rows' splits (the targets' attention under the automatic split):
    /// `KEYS:SPLIT,...`, a row that sees at least KEYS keys takes SPLIT keys per split (the
    /// last entry that applies), e.g. `0:256,16384:512,32768:1024`
    /// (`Cuda::set_attn_causal_splits`; default the library's table).
    #[arg(long)]
    attn_causal: Option<String>,
    /// Attention kernel for the step: auto (the library default), simt (f32 CUDA cores),
    /// tc2, tc4 (tensor cores, 2 / 4 key warps per chunk), tc2f, tc4f (the same with P V on
    /// the CUDA cores), each optionally followed by rN (row warps per block) and sN (pipeline
    /// stages) (a benchmark knob).
    #[arg(long, default_value = "auto")]
    attn_kernel: String,
    /// Only run one attention call (8B shape, 16 queries, this context) three times, then
    /// exit (for a profiler).
    #[arg(long)]
    attn_once: Option<usize>,
    /// With --attn-once: the call through `attention_fast`.
    #[arg(long)]
    attn_fast: bool,
    /// With --attn-once: write the output (f32, little endian) to this file (to compare the
    /// bits of two builds).
    #[arg(long)]
    attn_dump: Option<PathBuf>,
    /// With --attn-once --kv16: time the call (split + combine, a graph of 20 calls) under
    /// these FA choices, comma-separated: `nofa`, `fabN` (long spans, splits for N blocks per
    /// SM), `faall` (every call), `nowg` (the mma.sync FA kernel), `+`-joined, each optionally
    /// `:sN` (N stages).
    #[arg(long)]
    fa_sweep: Option<String>,
    /// The FA f16-cache attention kernel for the whole run: `default`, `nofa`, `fabN`, `faall`
    /// or `nowg` (as --fa-sweep).
    #[arg(long, default_value = "default")]
    attn_fa: String,
    /// L2 prefetch of the coming weights during the step, MB per prefetch point: e.g.
    /// `A24B40C24D16E24` (A after the down projection: the next q/k/v; B after q/k/v: o,
    /// then gate/up; C after o: gate/up; D after gate/up: down; E after the last down: the
    /// lm_head); empty = none. Changes no result. Default none: B32C16 paid off with the
    /// kernels of the fourth session (8B 0.750 -> 0.721 ms at ctx 512); with the tenth
    /// session's tree it costs time (H200, one lease, two rounds, q8_0a8 + fast attention,
    /// B32C16 -> none: 8B 0.618 -> 0.616 ms at ctx 512, 0.778 -> 0.766 at 8192; 27B 1.064 ->
    /// 1.053, 1.179 -> 1.169; A16 / B16 / C16 / D16 alone: within the spread of none or slower).
    #[arg(long, default_value = "")]
    l2_prefetch: String,
    /// The step with the separate ops instead of the fused launches (same bits).
    #[arg(long)]
    unfused: bool,
    /// bf16 / q8_0 / q4_0 weights: the attention then `Backend::layer_tail` as two calls (the
    /// o projection's x split by its own launch) instead of `Backend::attention_layer_tail`,
    /// whose combine writes that x, as the targets and the drafter call it (same bits).
    #[arg(long)]
    separate_attn_tail: bool,
    /// bf16 / q8_0 / q4_0 weights: the norms and the SiLU product write f32 rows that a split
    /// launch converts for each skinny matmul, and the down projection's output is added by
    /// its own launch, instead of the producers writing the skinny matmuls' x (same bits;
    /// `Cuda::set_skinny_producers`).
    #[arg(long)]
    no_skinny_producers: bool,
    /// Q8_0A8: the quantizer launches of before instead of the producers writing the
    /// quantized activation (rms_norm_q8, attention_q8) and the residual adds inside the o /
    /// down projections (matmul_many_q8 / matmul_silu_mul_add); the same bits.
    #[arg(long)]
    no_a8_producers: bool,
    /// Only the per-op breakdown (matmul, attention, norm at the 8B shape), then exit.
    #[arg(long)]
    ops_only: bool,
    /// Only the timeline of the q8_0a8 + fast-attention step (the --shapes and --ctx given;
    /// q4_0a8 where --formats starts with it, as for --trace and --a8-sweep):
    /// an event recorded after each op of a graph replay (an event-record node on a side
    /// stream per op, so no op waits for it), median over --iters replays: us from the
    /// previous mark, per op and summed per kind of op; then exit.
    #[arg(long)]
    timeline: bool,
    /// Only the per-block trace of the q8_0a8 + fast-attention step (the --shapes and --ctx
    /// given; kernels compiled with `CudaOptions::block_trace`): one graph replay's records
    /// written as CSV to this file (shape, ctx, module, line, kind, sm, t0_ns, t1_ns, block,
    /// blocks); read it with `tools/bench/block_trace.py`. Then exit.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Only the library drafter's step (`dflash_draft_model::Drafter::draft`: Q8_0A8, the fast
    /// attention, random weights, a Q8_0A8 embedding and lm_head lent as the target's) at the
    /// --shapes and --ctx given, beside this bench's own step of the same shape (eager and
    /// graph), wall-clock ms per call including the host synchronization, then exit.
    #[arg(long)]
    library: bool,
    /// With --timeline / --library / --attn-once: the drafter's K / V caches in f16 (the
    /// attention through `attention_fast_kv16`; the library drafter loaded with `kv_storage:
    /// F16`).
    #[arg(long)]
    kv16: bool,
    /// Graph times as back-to-back replays (events around `--iters` launches, divided by
    /// them: the host's launch latency hidden behind the replay before, as in an engine that
    /// enqueues the step behind other work) instead of one replay between two events.
    #[arg(long)]
    b2b: bool,
    /// Only the norm -> projection chain timings (us per instance; 10 distinct q/k/v weight
    /// copies per graph), then exit.
    #[arg(long)]
    norm_chain: bool,
    /// Only the A8 matmuls at the 8B step's shapes (16 rows, the automatic kernel, Q8_0A8 and
    /// Q4_0A8; enough distinct weight copies per graph that they stream from HBM): us per
    /// call and the share of the copy bandwidth, then exit. Optionally a comma list of the
    /// launches to run (q/k/v, o, gate/up, down, lm_head), each optionally `:q8` or `:q4`
    /// (for a profiler).
    #[arg(long, num_args = 0..=1, default_missing_value = "all")]
    a8_probe: Option<String>,
    /// Only the q8_0a8 projections and draft step (the --shapes and --ctx given) under each of
    /// these configurations, two interleaved rounds, then exit: a comma list of --a8-kernel
    /// names, each optionally followed by +noef, +nopdl, +asN (attention split), +att=NAME,
    /// +pf=SPEC (L2 prefetch, as --l2-prefetch), +skip=LETTERS (timing ablation: launches
    /// left out, letters of nkqaogdl = norms, q/k/v, q/k norm + RoPE, attention, o, gate/up,
    /// down, lm_head; the step's results are then meaningless; n and a need +noq8n; N: with
    /// the producers, the norms whose consumer can read the first activation slot's older
    /// contents of the same shape, at 8B all but the first and the final norm), +fa (the
    /// attention through `attention_fast`), +q8n / +noq8n (the Q8_0A8 producers on / off,
    /// default as --no-a8-producers says), +q8e (only the residual adds inside the o / down
    /// projections, plain norms and quantizers), +nopair (with the producers: gate / up as
    /// `matmul_many_q8` and the SiLU product in the down projection's quantizer), +qkv=K / +o=K
    /// / +gu=K / +down=K (that projection's Q8_0A8 kernel, an --a8-kernel name), +pw=BBBB
    /// (1: all but one weight stage before the dependency wait, 0: one; q/k/v, o, gate/up,
    /// down), +gp=kKSsS
    /// (the paired gate / up kernel: k-slices, stages), +noq (the paired launch without its
    /// queue for the leftover groups), +x1 (the fast attention through the
    /// 1xTF32 kernel instead of the f16 one), +mksteps (the Markov chain as two launches per
    /// step, not one persistent launch), +co=A/O (the preferred shared-memory carveouts in
    /// percent, A: the Q8_0A8 matmuls', O: every other kernel's; -1: the driver's choice;
    /// default 100/-1); with --markov the sweep's step is the DSpark step).
    #[arg(long)]
    a8_sweep: Option<String>,
    /// The preferred shared-memory carveouts for the whole run, A/O in percent (A: the Q8_0A8
    /// matmuls', O: every other kernel's; -1: the driver's choice); `Cuda::set_smem_carveout`
    /// (the same bits; a benchmark knob). Default: the library's, 100/-1.
    #[arg(long, allow_hyphen_values = true)]
    carveout: Option<String>,
    /// Time the dense 8B target's prefill (one forward of P prompt tokens from position 0,
    /// the last row's logits) at each prompt length of this list, for each of
    /// `--target-formats`, beside a PyTorch bf16 prefill of the same shape
    /// (`tools/bench/torch_prefill.py`, unless `--no-torch`); then exit.
    #[arg(long)]
    prefill: Option<String>,
    /// With --prefill: the keys per split of its causal attention, each value of this list in
    /// turn (`Cuda::set_attn_prefill_split`; 0 = the splits of the keys each row sees;
    /// default the library's, one split up to 2^20 keys).
    #[arg(long, default_value = "1048576")]
    attn_prefill: String,
    /// With --prefill: its arithmetic, each entry of this list in turn (`exact`, `fast`:
    /// `Cuda::set_prefill_precision`).
    #[arg(long, default_value = "exact")]
    prefill_precision: String,
    /// With --prefill: its causal attention through the FlashAttention-2-style kernels or
    /// not, each entry of this list in turn (`on`, `off`: `Cuda::set_attn_prefill_fa`).
    #[arg(long, default_value = "on")]
    attn_prefill_fa: String,
    /// With --prefill: the norms, SiLU product and attention combine writing the cuBLAS
    /// matmuls' bf16 x, and the q / k norm + RoPE one block per row, or not, each entry of
    /// this list in turn (`on`, `off`: `Cuda::set_prefill_producers`).
    #[arg(long, default_value = "on")]
    prefill_producers: String,
    /// With --prefill: the values of W per row block its cuBLAS matmuls of packed bf16 or
    /// block-format weights unpack at a time, in Mi (2^20) values, each entry of this list in
    /// turn (`Cuda::set_unpack_block`; default the library's, 64).
    #[arg(long, default_value = "64")]
    unpack_block: String,
    /// Time a Gated DeltaNet layer's recurrent ops (`causal_conv1d` and `gated_delta_rule`)
    /// at the Qwen3.6-27B target's linear-layer shape (16 key / 48 value heads of 128, conv
    /// kernel 4) for each token count of this list (16 and fewer: with the per-token stash of
    /// a verify), with `Cuda::set_recurrent_parallel` on and off, beside PyTorch
    /// (`tools/bench/torch_gdn.py`, unless `--no-torch`); then exit.
    #[arg(long)]
    recurrent: Option<String>,
    /// Time the hybrid target (Gated DeltaNet + gated full attention) at the Qwen3.6-27B
    /// layer shape, 4 layers (3 linear + 1 full), bf16, random weights: the prefill of P
    /// tokens for each P of this list, then a decode (1 token) and a verify (16 tokens, the
    /// stash arm) from context P, each committing one row; `Cuda::set_recurrent_parallel` on and off;
    /// beside transformers' Qwen3.5 model at the same shape (`tools/bench/torch_hybrid.py`,
    /// unless `--no-torch`); then exit.
    #[arg(long)]
    hybrid: Option<String>,
    /// With --hybrid: also time the fused prompt attention (`AttnGemm::Fused`) at each
    /// kernel shape of this list, `KEYS:STAGES:ROWS` entries (`Cuda::set_attn_pf2_shape`),
    /// exact and fast.
    #[arg(long)]
    pf2_shapes: Option<String>,
    /// With --hybrid: instead of the tables, one prefill of each P at this precision (`exact`
    /// or `fast`), then a decode and a 16-token verify from it, each between
    /// `cuProfilerStart` and `cuProfilerStop` after an unprofiled one (for `ncu
    /// --profile-from-start off`: those calls' kernels alone); then exit.
    #[arg(long)]
    profile_prefill: Option<String>,
    /// With --hybrid: also the prefill (exact and fast) with the backend's memory pool keeping
    /// none of its freed memory (`Cuda::set_pool_keep(0)`) and with `Backend::zeros` left
    /// unfilled (`Cuda::set_zero_fill`, a timing ablation).
    #[arg(long)]
    alloc_ablation: bool,
    /// Write the markdown report here (it is printed either way).
    #[arg(long)]
    md: Option<PathBuf>,
}

#[derive(Clone, Debug)]
struct Shape {
    name: &'static str,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    vocab: usize,
    block: usize,
    windows: Vec<Option<usize>>,
}

fn shape(name: &str) -> Result<Shape> {
    Ok(match name {
        "8b" => Shape {
            name: "Qwen3-8B-DFlash-b16",
            hidden: 4096,
            layers: 5,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            inter: 12288,
            vocab: 151936,
            block: 16,
            windows: vec![None; 5],
        },
        "27b" => Shape {
            name: "Qwen3.6-27B-DFlash",
            hidden: 5120,
            layers: 5,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            inter: 17408,
            vocab: 248320,
            block: 16,
            windows: vec![Some(2048), Some(2048), Some(2048), Some(2048), None],
        },
        _ => bail!("unknown shape {name} (8b, 27b)"),
    })
}

/// The dense Qwen3-8B target: the 8B drafter shape's layers, 36 of them, no windows.
fn dense_8b_target() -> Result<Shape> {
    Ok(Shape {
        name: "Qwen3-8B (dense target)",
        layers: 36,
        windows: vec![None; 36],
        ..shape("8b")?
    })
}

/// The dense target of one `--target-formats` entry (`FORMAT`, or `FORMAT+kv16` for its K / V
/// cache in f16: `LoadOptions::kv_storage`, its attention through `attention_fast_kv16`), with
/// random weights for `cap` positions; its format and its label.
fn target_model(
    g: &Cuda,
    s: &Shape,
    entry: &str,
    cap: usize,
) -> Result<(Model, WeightFormat, String)> {
    let (name, kv16) = match entry.trim().strip_suffix("+kv16") {
        Some(n) => (n, true),
        None => (entry.trim(), false),
    };
    let tf = parse_format(name)?;
    let mut m = Model::new(g, s, tf, cap, false, 4242)?;
    if kv16 {
        m.set_kv(g, KvStorage::F16)?;
    }
    let label = if kv16 {
        format!("{} + f16 KV", fmt_name(tf))
    } else {
        fmt_name(tf).to_string()
    };
    Ok((m, tf, label))
}

pub(crate) fn parse_format(s: &str) -> Result<WeightFormat> {
    Ok(match s {
        "bf16" => WeightFormat::Bf16,
        "f16" => WeightFormat::F16,
        "f32" => WeightFormat::F32,
        "q8_0" => WeightFormat::Q8_0,
        "q8_0a8" => WeightFormat::Q8_0A8,
        "q4_0" => WeightFormat::Q4_0,
        "q4_0a8" => WeightFormat::Q4_0A8,
        _ => bail!("unknown format {s}"),
    })
}

struct Layer {
    ln1: CudaBuf,
    ln2: CudaBuf,
    qn: CudaBuf,
    kn: CudaBuf,
    wq: Weight<Cuda>,
    wk: Weight<Cuda>,
    wv: Weight<Cuda>,
    wo: Weight<Cuda>,
    wg: Weight<Cuda>,
    wu: Weight<Cuda>,
    wd: Weight<Cuda>,
    kc: CudaBuf,
    vc: CudaBuf,
    window: Option<usize>,
}

/// A Qwen3-style stack: the drafter (non-causal block attention) or the dense target (causal).
struct Model {
    s: Shape,
    embed: Weight<Cuda>,
    lm_head: Weight<Cuda>,
    norm: CudaBuf,
    layers: Vec<Layer>,
    markov: Option<(Weight<Cuda>, Weight<Cuda>)>,
    /// Fused launches (q/k norm + RoPE + KV write, residual add + RMSNorm, SiLU into the
    /// down projection's quantizer); false = the separate ops (same bits).
    fused: bool,
    /// Fused bf16 / q8_0 / q4_0 layers: the attention and the layer tail through
    /// [`Backend::attention_layer_tail`] (as the targets and the drafter call them); false =
    /// the attention, then [`Backend::layer_tail`] (same bits).
    attn_tail: bool,
    /// Fused Q8_0A8 / Q4_0A8 layers through the library's layer ops too (what the targets
    /// call, e.g. for a prefill), not the step's own sequence of Q8_0A8 launches.
    lib_a8: bool,
    /// L2 prefetch budgets (bytes) at the step's prefetch points (see [`PfPoint`]); zeros =
    /// no prefetch launches.
    prefetch: [usize; 5],
    /// Launches left out (timing ablations only; the results are then meaningless): letters
    /// of `nkqaogdl` = norms, q/k/v, q/k norm + RoPE, attention, o, gate/up, down, lm_head.
    skip: String,
    /// The attention through [`Backend::attention_fast`] (the drafter's reduced-precision op).
    fast_attn: bool,
    /// How the layers' K / V caches are stored (see [`Model::set_kv`]); f16 = the attention
    /// through [`Backend::attention_fast_kv16`].
    kv: KvStorage,
    /// Q8_0A8 only: the norms write the quantized activation (`Cuda::rms_norm_q8`) and the
    /// o / down projections add into the residual stream (`Cuda::matmul_add`,
    /// `matmul_silu_mul_add`): the same bits, fewer launches.
    q8norm: bool,
    /// Q8_0A8 only: the o / down projections add into the residual stream, the norms are
    /// plain `rms_norm` (implied by `q8norm`).
    q8epi: bool,
    /// With `q8norm`: gate / up as one paired launch that writes the down projection's
    /// activation (`Cuda::matmul_gate_up_q8`).
    q8pair: bool,
    /// Q8_0A8 kernel per projection (q/k/v, o, gate/up, down; None = `base_kernel`), a sweep
    /// knob (every choice gives the same bits).
    proj_kernels: [Option<A8Kernel>; 4],
    /// All but one weight stage before the dependency wait, per projection (q/k/v, o,
    /// gate/up, down; `Cuda::set_a8_prewait`; None = the backend's rule), a sweep knob.
    prewait: Option<[bool; 4]>,
    base_kernel: A8Kernel,
    rope: RopeSpec,
    /// Timeline marks after each op (`--timeline`): none by default.
    timeline: Option<Timeline>,
}

/// `Cuda::timeline_mark` events of one step: one after each op, by name.
struct Timeline {
    events: Vec<cudarc::driver::CudaEvent>,
    names: Vec<String>,
}

impl Timeline {
    /// Mark `*n` (named `name`) after everything queued so far.
    fn mark(&mut self, g: &Cuda, n: &mut usize, name: impl FnOnce() -> String) -> Result<()> {
        if self.events.len() <= *n {
            let ev = g
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            self.events.push(ev);
            self.names.push(name());
        }
        g.timeline_mark(&self.events[*n])?;
        *n += 1;
        Ok(())
    }
}

/// Where the step hints the L2 to fetch the weights coming next (each right after a
/// projection, so the fetch overlaps that projection's tail and the latency-bound kernels
/// after it): A after the down projection (the next layer's q/k/v; layer 0: at the start),
/// B after q/k/v (o, then gate/up), C after o (gate/up), D after gate/up (down), E after the
/// last down projection (the lm_head).
#[derive(Clone, Copy)]
enum PfPoint {
    A = 0,
    B = 1,
    C = 2,
    D = 3,
    E = 4,
}

/// Parse `A24B40C0D16E24` (MB per point; points not named are 0).
fn parse_prefetch(spec: &str) -> Result<[usize; 5]> {
    let mut b = [0usize; 5];
    let mut rest = spec.trim();
    while let Some(c) = rest.chars().next() {
        let i = "ABCDE"
            .find(c)
            .ok_or_else(|| anyhow::anyhow!("prefetch spec {spec}: unknown point {c}"))?;
        let digits: String = rest[1..]
            .chars()
            .take_while(|d| d.is_ascii_digit())
            .collect();
        b[i] = digits.parse::<usize>()? << 20;
        rest = &rest[1 + digits.len()..];
    }
    Ok(b)
}

struct Bufs {
    ids: CudaSlice<u32>,
    h: CudaBuf,
    x: CudaBuf,
    q0: CudaBuf,
    k0: CudaBuf,
    q: CudaBuf,
    k: CudaBuf,
    v: CudaBuf,
    attn: CudaBuf,
    o: CudaBuf,
    gate: CudaBuf,
    up: CudaBuf,
    act: CudaBuf,
    xl: CudaBuf,
    logits: CudaBuf,
    toks: CudaSlice<u32>,
    prev: CudaSlice<u32>,
}

fn ones(g: &Cuda, n: usize) -> Result<CudaBuf> {
    Ok(g.upload(&vec![1.0f32; n])?)
}

impl Model {
    fn new(
        g: &Cuda,
        s: &Shape,
        fmt: WeightFormat,
        cap: usize,
        markov: bool,
        seed: u64,
    ) -> Result<Self> {
        let (h, hd) = (s.hidden, s.head_dim);
        let mut sd = seed;
        let mut w = |name: &str, rows: usize, cols: usize| -> Result<Weight<Cuda>> {
            sd += 1;
            Ok(g.random_weight(name, rows, cols, fmt, sd, (cols as f32).powf(-0.5))?)
        };
        let mut layers = Vec::new();
        for li in 0..s.layers {
            let kv = cap * s.kv_heads * hd;
            let kc = g.random_buf(kv, seed + 1000 + li as u64, 1.0)?;
            let vc = g.random_buf(kv, seed + 2000 + li as u64, 1.0)?;
            layers.push(Layer {
                ln1: ones(g, h)?,
                ln2: ones(g, h)?,
                qn: ones(g, hd)?,
                kn: ones(g, hd)?,
                wq: w("wq", s.heads * hd, h)?,
                wk: w("wk", s.kv_heads * hd, h)?,
                wv: w("wv", s.kv_heads * hd, h)?,
                wo: w("wo", h, s.heads * hd)?,
                wg: w("wg", s.inter, h)?,
                wu: w("wu", s.inter, h)?,
                wd: w("wd", h, s.inter)?,
                kc,
                vc,
                window: s.windows.get(li).copied().flatten(),
            });
        }
        let embed = w("embed", s.vocab, h)?;
        let lm_head = w("lm_head", s.vocab, h)?;
        let markov = if markov {
            Some((w("markov_w1", s.vocab, 256)?, w("markov_w2", s.vocab, 256)?))
        } else {
            None
        };
        let inv_freq = (0..hd / 2)
            .map(|i| 1.0 / 1e6f32.powf(2.0 * i as f32 / hd as f32))
            .collect();
        Ok(Model {
            s: s.clone(),
            embed,
            lm_head,
            norm: ones(g, h)?,
            layers,
            markov,
            fused: true,
            attn_tail: true,
            lib_a8: false,
            prefetch: [0; 5],
            skip: String::new(),
            fast_attn: false,
            kv: KvStorage::F32,
            q8norm: false,
            q8epi: false,
            q8pair: true,
            proj_kernels: [None; 4],
            prewait: None,
            base_kernel: A8Kernel::Auto,
            timeline: None,
            rope: RopeSpec {
                inv_freq,
                attention_scaling: 1.0,
            },
        })
    }

    /// Store the layers' K / V caches as `kv` says (the same values, f16-rounded for
    /// [`KvStorage::F16`]; back to f32 exactly from f16).
    fn set_kv(&mut self, g: &Cuda, kv: KvStorage) -> Result<()> {
        if kv == self.kv {
            return Ok(());
        }
        for l in &mut self.layers {
            for c in [&mut l.kc, &mut l.vc] {
                let n = match self.kv {
                    KvStorage::F32 => g.len(c),
                    KvStorage::F16 => 2 * g.len(c),
                };
                let mut new = g.zeros(kv.slots(n))?;
                match kv {
                    KvStorage::F16 => g.f16_pack(c, &mut new, 0, n)?,
                    KvStorage::F32 => g.f16_unpack(c, 0, n, &mut new)?,
                }
                *c = new;
            }
        }
        self.kv = kv;
        Ok(())
    }

    /// Bytes a step must read from device memory at least: every weight matrix once (the
    /// lm_head in full, the embedding for `rows` rows) and the visible K/V of each layer (2 or
    /// 4 bytes per value, as the caches store them).
    fn floor_bytes(&self, rows: usize, ctx: usize) -> usize {
        let mut b =
            self.lm_head.buf.device_bytes() + self.embed.buf.device_bytes() / self.s.vocab * rows;
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.wg, &l.wu, &l.wd] {
                b += w.buf.device_bytes();
            }
            let keys = match l.window {
                Some(w) => (ctx + rows).min(w + rows),
                None => ctx + rows,
            };
            let per = match self.kv {
                KvStorage::F32 => 4,
                KvStorage::F16 => 2,
            };
            b += 2 * keys * self.s.kv_heads * self.s.head_dim * per;
        }
        b
    }

    /// The step's weight matrices in the order the step streams them.
    fn weight_at(&self, j: usize) -> &Weight<Cuda> {
        match self.layers.get(j / 7) {
            Some(l) => [&l.wq, &l.wk, &l.wv, &l.wo, &l.wg, &l.wu, &l.wd][j % 7],
            None => &self.lm_head,
        }
    }

    /// Prefetch point `pt` before the weight `first` (index into [`Model::weight_at`]): the
    /// point's budget of bytes from there on, past what earlier points already fetched
    /// (`cursor`: weight index and fraction), at most 3 matrices.
    fn prefetch_at(
        &self,
        g: &Cuda,
        cursor: &mut (usize, f64),
        pt: PfPoint,
        first: usize,
    ) -> Result<()> {
        let mut left = self.prefetch[pt as usize] as f64;
        if left <= 0.0 {
            return Ok(());
        }
        let (mut j, mut f) = if cursor.0 > first || (cursor.0 == first && cursor.1 > 0.0) {
            *cursor
        } else {
            (first, 0.0)
        };
        let n = 7 * self.layers.len() + 1;
        let mut parts = Vec::new();
        while left > 0.0 && j < n && parts.len() < 3 {
            let w = self.weight_at(j);
            let bytes = w.buf.device_bytes() as f64;
            let t = (f + left / bytes).min(1.0);
            parts.push((w, f..t));
            left -= (t - f) * bytes;
            (j, f) = if t >= 1.0 { (j + 1, 0.0) } else { (j, t) };
        }
        *cursor = (j, f);
        Ok(g.l2_prefetch(&parts)?)
    }

    fn bufs(&self, g: &Cuda, rows: usize) -> Result<Bufs> {
        let s = &self.s;
        let ids: Vec<u32> = (0..rows as u32)
            .map(|i| (i * 7919 + 13) % s.vocab as u32)
            .collect();
        Ok(Bufs {
            ids: g.upload_ids(&ids)?,
            h: g.zeros(rows * s.hidden)?,
            x: g.zeros(rows * s.hidden)?,
            q0: g.zeros(rows * s.heads * s.head_dim)?,
            k0: g.zeros(rows * s.kv_heads * s.head_dim)?,
            q: g.zeros(rows * s.heads * s.head_dim)?,
            k: g.zeros(rows * s.kv_heads * s.head_dim)?,
            v: g.zeros(rows * s.kv_heads * s.head_dim)?,
            attn: g.zeros(rows * s.heads * s.head_dim)?,
            o: g.zeros(rows * s.hidden)?,
            gate: g.zeros(rows * s.inter)?,
            up: g.zeros(rows * s.inter)?,
            act: g.zeros(rows * s.inter)?,
            xl: g.zeros(rows * s.hidden)?,
            logits: g.zeros(rows * s.vocab)?,
            toks: g.upload_ids(&vec![0u32; rows])?,
            prev: g.upload_ids(&[1u32])?,
        })
    }

    /// One forward of `rows` tokens at positions ctx.. over the cache; logits for rows
    /// `lm_from..rows`, then the Markov chain (if any) and the argmax, all on the device.
    fn forward(
        &mut self,
        g: &Cuda,
        b: &mut Bufs,
        rows: usize,
        ctx: usize,
        causal: bool,
        lm_from: usize,
    ) -> Result<()> {
        let s = self.s.clone();
        let (hd, eps) = (s.head_dim, 1e-6f32);
        let mut tl = self.timeline.take();
        let mut tn = 0usize;
        let mut mark = |name: &dyn Fn() -> String| -> Result<()> {
            match tl.as_mut() {
                Some(t) => t.mark(g, &mut tn, name),
                None => Ok(()),
            }
        };
        mark(&|| "start".into())?;
        g.gather_rows_dev(&self.embed, &b.ids, rows, &mut b.h)?;
        mark(&|| "gather".into())?;
        let fused = self.fused;
        let nl = self.layers.len();
        let skip = self.skip.clone();
        let sk = |c: char| skip.contains(c);
        let a8 = fused && self.lm_head.format.is_a8();
        let q8n = self.q8norm && a8;
        let q8e = (self.q8epi || self.q8norm) && a8;
        // The other formats, fused: what the targets' and the drafter's layers call (the
        // backend's norm_matmul_many before the attention, layer_tail after it, the final
        // norm after the last layer).
        let lib = fused && (!a8 || self.lib_a8);
        if q8n && (sk('n') || sk('a')) {
            bail!("+skip=n / +skip=a leave the Q8_0A8 producers out: add +noq8n");
        }
        // +skip=N (a timing ablation): a norm left out where the first activation slot already
        // holds an activation of its shape (at 8B the attention's), which its consumer reads.
        let stale = |here: bool| {
            (q8n && sk('N') && here)
                .then(|| g.a8_slot_token(0))
                .flatten()
                .filter(|a| a.k() == s.hidden && a.rows() == rows)
        };
        // The activation the last Q8_0A8 producer wrote (q8n).
        let mut act: Option<A8Act> = None;
        let need = |a: &Option<A8Act>| a.ok_or_else(|| anyhow!("no Q8_0A8 activation written"));
        let (pk, bk) = (self.proj_kernels, self.base_kernel);
        let pw = self.prewait;
        let kern = |i: usize| {
            g.set_a8_prewait(pw.map(|p| p[i]));
            g.set_a8_kernel(pk[i].unwrap_or(bk))
        };
        if fused && !lib && nl > 0 && !sk('n') {
            if q8n {
                act = Some(g.rms_norm_q8(&b.h, 0, rows, &self.layers[0].ln1, s.hidden, eps)?);
            } else {
                g.rms_norm(&b.h, &self.layers[0].ln1, s.hidden, eps, &mut b.x)?;
            }
            mark(&|| "L0 norm".into())?;
        }
        let mut cur = (0usize, 0.0f64);
        self.prefetch_at(g, &mut cur, PfPoint::A, 0)?;
        for li in 0..nl {
            let w0 = 7 * li;
            let l = &self.layers[li];
            if !fused {
                g.rms_norm(&b.h, &l.ln1, s.hidden, eps, &mut b.x)?;
            }
            // q/k/v (and gate/up below) through `matmul_many`: for Q8_0A8 one quantization of
            // x and one launch for the 3 (2) matrices; other formats: separate matmuls.
            kern(0);
            if sk('k') {
            } else if lib {
                g.norm_matmul_many(
                    &b.h,
                    &l.ln1,
                    s.hidden,
                    eps,
                    &mut b.x,
                    rows,
                    &[&l.wq, &l.wk, &l.wv],
                    &mut [&mut b.q0, &mut b.k0, &mut b.v],
                )?;
            } else if q8n {
                g.matmul_many_q8(
                    &need(&act)?,
                    &[&l.wq, &l.wk, &l.wv],
                    &mut [&mut b.q0, &mut b.k0, &mut b.v],
                    false,
                )?;
            } else {
                g.matmul_many(
                    &b.x,
                    rows,
                    &[&l.wq, &l.wk, &l.wv],
                    &mut [&mut b.q0, &mut b.k0, &mut b.v],
                )?;
            }
            mark(&|| format!("L{li} q/k/v"))?;
            self.prefetch_at(g, &mut cur, PfPoint::B, w0 + 3)?;
            let kvw = s.kv_heads * hd;
            let l = &mut self.layers[li];
            if sk('q') {
            } else if fused {
                // q/k RMSNorm + RoPE + K/V cache write: one launch, the bits of the 6 below.
                let qk = QkNormRope {
                    q_norm: &l.qn,
                    k_norm: &l.kn,
                    n_heads: s.heads,
                    n_kv_heads: s.kv_heads,
                    head_dim: hd,
                    eps,
                    pos0: ctx,
                    rope: &self.rope,
                };
                let cache = KvCacheRows {
                    k: &mut l.kc,
                    v: &mut l.vc,
                    row0: ctx,
                    storage: self.kv,
                };
                g.qk_norm_rope_kv(
                    &b.q0, &b.k0, &b.v, rows, rows, &qk, &mut b.q, &mut b.k, cache,
                )?;
            } else {
                g.rms_norm(&b.q0, &l.qn, hd, eps, &mut b.q)?;
                g.rms_norm(&b.k0, &l.kn, hd, eps, &mut b.k)?;
                g.rope(&mut b.q, rows, s.heads, hd, ctx, &self.rope)?;
                g.rope(&mut b.k, rows, s.kv_heads, hd, ctx, &self.rope)?;
                if self.kv == KvStorage::F16 {
                    g.f16_pack(&b.k, &mut l.kc, ctx * kvw, rows * kvw)?;
                    g.f16_pack(&b.v, &mut l.vc, ctx * kvw, rows * kvw)?;
                } else {
                    g.copy(&b.k, 0, &mut l.kc, ctx * kvw, rows * kvw)?;
                    g.copy(&b.v, 0, &mut l.vc, ctx * kvw, rows * kvw)?;
                }
            }
            mark(&|| format!("L{li} qk norm+rope+kv"))?;
            let l = &self.layers[li];
            // The layer tail's weights (o, the post-attention norm, the MLP).
            let tail = LayerTail {
                wo: &l.wo,
                post_norm: &l.ln2,
                eps,
                w_gate: &l.wg,
                w_up: &l.wu,
                w_down: &l.wd,
            };
            let p = AttnParams {
                n_q: rows,
                n_kv: ctx + rows,
                n_heads: s.heads,
                n_kv_heads: s.kv_heads,
                head_dim: hd,
                q_pos0: ctx,
                kv_pos0: 0,
                causal,
                window: l.window,
                scale: (hd as f32).powf(-0.5),
            };
            if lib && self.attn_tail && !sk('a') && !sk('o') {
                // The attention and the tail as the targets' and the drafter's layers call them.
                let op = match (self.kv, self.fast_attn) {
                    (KvStorage::F16, _) => AttnOp::FastKv16,
                    (_, true) => AttnOp::Fast,
                    _ => AttnOp::Exact,
                };
                let scratch = TailScratch {
                    o: &mut b.o,
                    xn: &mut b.x,
                    gate: &mut b.gate,
                    up: &mut b.up,
                    act: &mut b.act,
                };
                g.attention_layer_tail(
                    &b.q,
                    &l.kc,
                    &l.vc,
                    &p,
                    op,
                    &mut b.attn,
                    &mut b.h,
                    &tail,
                    scratch,
                )?;
                mark(&|| format!("L{li} attention + tail"))?;
                continue;
            }
            if sk('a') {
            } else if q8n {
                // The split combine also writes the o projection's quantized activation.
                act = Some(g.attention_q8(
                    &b.q,
                    &l.kc,
                    &l.vc,
                    &p,
                    self.fast_attn,
                    self.kv,
                    &mut b.attn,
                )?);
            } else if self.kv == KvStorage::F16 {
                g.attention_fast_kv16(&b.q, &l.kc, &l.vc, &p, &mut b.attn)?;
            } else if self.fast_attn {
                g.attention_fast(&b.q, &l.kc, &l.vc, &p, &mut b.attn)?;
            } else {
                g.attention(&b.q, &l.kc, &l.vc, &p, &mut b.attn)?;
            }
            mark(&|| format!("L{li} attention"))?;
            kern(1);
            if lib {
                // o, the residual add + norm, gate / up, the SiLU product, down + the add.
                if !sk('o') {
                    let scratch = TailScratch {
                        o: &mut b.o,
                        xn: &mut b.x,
                        gate: &mut b.gate,
                        up: &mut b.up,
                        act: &mut b.act,
                    };
                    g.layer_tail(&b.attn, rows, &mut b.h, &tail, scratch)?;
                }
                mark(&|| format!("L{li} tail"))?;
                continue;
            }
            if sk('o') {
            } else if q8n && !sk('a') {
                g.matmul_many_q8(&need(&act)?, &[&l.wo], &mut [&mut b.h], true)?;
            } else if q8e {
                g.matmul_add(&b.attn, rows, &l.wo, &mut b.h)?;
            } else {
                g.matmul(&b.attn, rows, &l.wo, &mut b.o)?;
            }
            mark(&|| format!("L{li} o"))?;
            self.prefetch_at(g, &mut cur, PfPoint::C, w0 + 4)?;
            let next_norm = self.layers.get(li + 1).map_or(&self.norm, |n| &n.ln1);
            if q8e {
                // The residual adds inside the o / down projections' stores; with q8norm the
                // norms write the next projections' quantized activation (same bits, 3
                // launches fewer).
                if sk('n') {
                } else if let Some(a) = stale(true) {
                    act = Some(a);
                } else if q8n {
                    act = Some(g.rms_norm_q8(&b.h, 0, rows, &l.ln2, s.hidden, eps)?);
                } else {
                    g.rms_norm(&b.h, &l.ln2, s.hidden, eps, &mut b.x)?;
                }
                mark(&|| format!("L{li} norm2"))?;
                // With the paired gate / up launch the SiLU product is quantized in its
                // epilogue (the down projection's activation; no f32 gate / up).
                let paired = q8n && self.q8pair && !sk('g');
                kern(2);
                if sk('g') {
                } else if paired {
                    act = Some(g.matmul_gate_up_q8(&need(&act)?, &l.wg, &l.wu)?);
                } else if q8n {
                    g.matmul_many_q8(
                        &need(&act)?,
                        &[&l.wg, &l.wu],
                        &mut [&mut b.gate, &mut b.up],
                        false,
                    )?;
                } else {
                    g.matmul_many(&b.x, rows, &[&l.wg, &l.wu], &mut [&mut b.gate, &mut b.up])?;
                }
                mark(&|| format!("L{li} gate/up"))?;
                self.prefetch_at(g, &mut cur, PfPoint::D, w0 + 6)?;
                kern(3);
                if sk('d') {
                } else if paired {
                    g.matmul_many_q8(&need(&act)?, &[&l.wd], &mut [&mut b.h], true)?;
                } else {
                    g.matmul_silu_mul_add(&b.gate, &b.up, rows, &l.wd, &mut b.h)?;
                }
                mark(&|| format!("L{li} down"))?;
            } else if fused {
                // Residual add + the next RMSNorm in one launch (same bits as the two ops);
                // SiLU * up inside the down projection's x quantizer (Q8_0A8).
                if !sk('n') {
                    g.add_rms_norm(&mut b.h, &b.o, &l.ln2, rows, s.hidden, eps, &mut b.x)?;
                }
                if !sk('g') {
                    g.matmul_many(&b.x, rows, &[&l.wg, &l.wu], &mut [&mut b.gate, &mut b.up])?;
                }
                self.prefetch_at(g, &mut cur, PfPoint::D, w0 + 6)?;
                if !sk('d') {
                    g.matmul_silu_mul(&b.gate, &b.up, &mut b.act, rows, &l.wd, &mut b.o)?;
                }
            } else {
                g.add_assign(&mut b.h, 0, &b.o, rows * s.hidden)?;
                g.rms_norm(&b.h, &l.ln2, s.hidden, eps, &mut b.x)?;
                g.matmul_many(&b.x, rows, &[&l.wg, &l.wu], &mut [&mut b.gate, &mut b.up])?;
                self.prefetch_at(g, &mut cur, PfPoint::D, w0 + 6)?;
                g.silu_mul(&b.gate, &b.up, &mut b.act)?;
                g.matmul(&b.act, rows, &l.wd, &mut b.o)?;
            }
            if li + 1 < nl {
                self.prefetch_at(g, &mut cur, PfPoint::A, w0 + 7)?;
            } else {
                self.prefetch_at(g, &mut cur, PfPoint::E, w0 + 7)?;
            }
            if sk('n') {
            } else if let Some(a) = stale(li + 1 < nl) {
                act = Some(a);
            } else if q8n {
                // The last layer's: the final norm of the lm_head rows only.
                let (r0, n) = if li + 1 < nl {
                    (0, rows)
                } else {
                    (lm_from, rows - lm_from)
                };
                act = Some(g.rms_norm_q8(&b.h, r0, n, next_norm, s.hidden, eps)?);
            } else if q8e {
                g.rms_norm(&b.h, next_norm, s.hidden, eps, &mut b.x)?;
            } else if fused {
                g.add_assign(&mut b.h, 0, &b.o, rows * s.hidden)?;
            }
            mark(&|| {
                if li + 1 < nl {
                    format!("L{} norm", li + 1)
                } else {
                    "final norm".into()
                }
            })?;
        }
        if !fused || lib || nl == 0 {
            g.rms_norm(&b.h, &self.norm, s.hidden, eps, &mut b.x)?;
        }
        let n = rows - lm_from;
        g.set_a8_kernel(bk);
        if q8n && nl > 0 {
            if !sk('l') {
                g.matmul_many_q8(&need(&act)?, &[&self.lm_head], &mut [&mut b.logits], false)?;
            }
        } else {
            g.copy(&b.x, lm_from * s.hidden, &mut b.xl, 0, n * s.hidden)?;
            if !sk('l') {
                g.matmul(&b.xl, n, &self.lm_head, &mut b.logits)?;
            }
        }
        mark(&|| "lm_head".into())?;
        match &self.markov {
            Some((w1, w2)) => {
                g.markov_chain_dev(&mut b.logits, n, s.vocab, &mut b.prev, &mut b.toks, w1, w2)?
            }
            None => g.argmax_rows_dev(&b.logits, 0, n, s.vocab, &mut b.toks)?,
        }
        mark(&|| "argmax".into())?;
        if self.prefetch.iter().any(|&b| b > 0) {
            g.l2_prefetch_join()?;
        }
        if tl.is_some() {
            g.timeline_join()?;
        }
        self.timeline = tl;
        Ok(())
    }
}

/// Median wall-clock milliseconds of `f` followed by a stream synchronization, over `iters`
/// runs (after 3 warm-up runs).
fn wall_ms(g: &Cuda, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let st = g.stream().clone();
    for _ in 0..3 {
        f()?;
    }
    st.synchronize()?;
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = std::time::Instant::now();
        f()?;
        st.synchronize()?;
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2])
}

/// `--library`: the library drafter's `draft()` at a bench shape beside the bench's own step.
fn library_step(g: &Cuda, a: &BenchArgs, shapes: &[Shape], ctxs: &[usize]) -> Result<()> {
    use dflash_draft_model::random::random_tensor_map;
    use dflash_draft_model::{DraftOptions, Drafter, LentWeights, LoadOptions, Precision};
    println!("| shape | ctx | library draft() ms | bench step eager ms | bench step graph ms | library / bench graph | ingest of 8 rows ms |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for s in shapes {
        // The z-lab layout of the shape: 5 target taps, layer types from the windows.
        let taps = [1i64, 9, 17, 25, 33];
        let types: Vec<&str> = s
            .windows
            .iter()
            .map(|w| {
                if w.is_some() {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        let window = s.windows.iter().flatten().next().copied();
        let cfg = crate::cpu::zlab_draft_config(
            [
                s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.inter, s.vocab,
            ],
            s.block,
            &taps,
            &types,
            window,
        )?;
        let map = random_tensor_map(&cfg, 7);
        let opts = LoadOptions {
            precision: Precision::Q8_0A8,
            fast_attention: true,
            kv_storage: kv_arg(a),
            ..Default::default()
        };
        let dr = Drafter::from_tensors(g, cfg, &map, &opts)?;
        drop(map);
        let f = WeightFormat::Q8_0A8;
        let lend = LentWeights::new(
            g.random_weight("embed", s.vocab, s.hidden, f, 11, 1.0)?,
            g.random_weight("lm_head", s.vocab, s.hidden, f, 12, 1.0 / 64.0)?,
        )?;
        let cap = ctxs.iter().max().copied().unwrap_or(512) + s.block;
        let mut m = Model::new(g, s, f, cap, false, 42)?;
        m.fast_attn = true;
        m.set_kv(g, kv_arg(a))?;
        m.q8norm = !a.no_a8_producers;
        let mut b = m.bufs(g, s.block)?;
        for &ctx in ctxs {
            let mut kv = dr.new_kv(g, ctx + s.block)?;
            let feats: Vec<f32> = (0..ctx * taps.len() * s.hidden)
                .map(|i| ((i % 251) as f32 - 125.0) / 125.0)
                .collect();
            // A round's ingest: the target features of 8 accepted rows (tau ~6.5 + the bonus
            // token), appended after the context and cropped off again.
            let feats8 = g.upload(&feats[..8 * taps.len() * s.hidden])?;
            let feats = g.upload(&feats)?;
            dr.ingest(g, &mut kv, &feats, ctx, 0)?;
            let ingest = wall_ms(g, a.iters, || {
                dr.ingest(g, &mut kv, &feats8, 8, ctx)?;
                kv.crop(ctx)?;
                Ok(())
            })?;
            let o = DraftOptions {
                markov: false,
                ..Default::default()
            };
            let lib = wall_ms(g, a.iters, || {
                dr.draft(g, &mut kv, &lend, 1, ctx, &o)?;
                Ok(())
            })?;
            let eager = wall_ms(g, a.iters, || m.forward(g, &mut b, s.block, ctx, false, 1))?;
            let t = time_forward(g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)?;
            let graph = t.graph.unwrap_or(f64::NAN);
            println!(
                "| {} | {ctx} | {lib:.3} | {eager:.3} | {graph:.3} | {:.2}x | {ingest:.3} |",
                s.name,
                lib / graph
            );
        }
    }
    Ok(())
}

/// Median milliseconds of `f` over `iters` runs, timed with device events.
/// `--prefill`: the dense 8B target's prompt forward (rows = P from position 0, causal, the
/// last row's logits) per target format and prompt length, eager launches (a prefill is a few
/// hundred launches of long kernels), median of `--iters` (at most 5); the matmul and attention
/// FLOPs over that time; PyTorch bf16 (cuBLAS + SDPA) beside it.
fn prefill(g: &Cuda, a: &BenchArgs, list: &str) -> Result<()> {
    let ps: Vec<usize> = list
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()?;
    let s = dense_8b_target()?;
    let cap = ps.iter().max().copied().unwrap_or(512);
    copy_bandwidth(g)?;
    g.set_attn_kernel(parse_attn_kernel(&a.attn_kernel)?)?;
    for (name, regs, local) in g.attn_kernel_info()? {
        println!(
            "attention kernel {name}: {regs} registers, {local} bytes local memory per thread"
        );
    }
    let params = s.layers
        * (s.hidden * (2 * s.heads + 2 * s.kv_heads) * s.head_dim + 3 * s.hidden * s.inter);
    let flops = |p: usize| {
        let mm = 2.0 * params as f64 * p as f64;
        // QK^T and PV over the causal triangle (p (p + 1) / 2 pairs), every head.
        let att = 4.0 * (s.layers * s.heads * s.head_dim) as f64 * (p * (p + 1) / 2) as f64;
        (mm, att)
    };
    let torch = if a.no_torch {
        Vec::new()
    } else {
        match run_torch_prefill(&s, &ps, a.iters.min(5)) {
            Ok(v) => v,
            Err(e) => {
                println!("PyTorch prefill: {e:#}");
                Vec::new()
            }
        }
    };
    let mut md = format!(
        "Dense target prefill at the Qwen3-8B shape ({} layers, random weights), {} ({} SMs): one forward of P tokens from position 0, the last row's logits; eager launches, median of {}.\n\n| target | P | ms | tok/s | TFLOP/s (matmul + attention) | PyTorch bf16 ms | PyTorch / ours |\n|---|---:|---:|---:|---:|---:|---:|\n",
        s.layers,
        g.context().name()?,
        g.num_sms(),
        a.iters.min(5)
    );
    for entry in a.target_formats.split(',') {
        let (mut m, tf, label) = target_model(g, &s, entry, cap)?;
        m.fused = !a.unfused;
        m.attn_tail = !a.separate_attn_tail;
        // Every format through the library's layer ops, as `Qwen3Dense::prime` calls them.
        m.lib_a8 = true;
        // The block formats both ways: cuBLAS from 17 rows, and the skinny kernels 16 rows
        // at a time (`Cuda::set_quant_prefill_rows`).
        let quant = !matches!(tf, WeightFormat::Bf16 | WeightFormat::F32);
        let modes: &[(&str, Option<usize>)] = if quant {
            &[
                (" (cuBLAS)", Some(SKINNY_ROWS + 1)),
                (" (skinny)", Some(usize::MAX)),
            ]
        } else {
            &[("", None)]
        };
        let splits: Vec<usize> = a
            .attn_prefill
            .split(',')
            .map(|c| c.trim().parse())
            .collect::<Result<_, _>>()?;
        let precisions: Vec<PrefillPrecision> = a
            .prefill_precision
            .split(',')
            .map(|c| match c.trim() {
                "exact" => Ok(PrefillPrecision::Exact),
                "fast" => Ok(PrefillPrecision::Fast),
                o => Err(anyhow!("--prefill-precision {o}: expected exact or fast")),
            })
            .collect::<Result<_>>()?;
        let fas = on_off_list("--attn-prefill-fa", &a.attn_prefill_fa)?;
        let prods = on_off_list("--prefill-producers", &a.prefill_producers)?;
        let blocks: Vec<usize> = a
            .unpack_block
            .split(',')
            .map(|c| c.trim().parse::<usize>().map(|m| m << 20))
            .collect::<Result<_, _>>()?;
        let mut runs = Vec::new();
        for &p in &ps {
            for &mf in modes {
                for &sp in &splits {
                    for &pp in &precisions {
                        for &fa in &fas {
                            for &pr in &prods {
                                for &ub in &blocks {
                                    runs.push((p, mf, sp, pp, fa, pr, ub));
                                }
                            }
                        }
                    }
                }
            }
        }
        for (p, (mode, from), split, pp, fa, pr, ub) in runs {
            g.set_unpack_block(ub);
            g.set_quant_prefill_rows(from);
            g.set_attn_prefill_split(split)?;
            g.set_prefill_precision(pp);
            g.set_attn_prefill_fa(fa);
            g.set_prefill_producers(pr);
            let mut label = format!("{label}{mode}");
            if splits.len() > 1 {
                label += &format!(", attention split {split}");
            }
            if pp == PrefillPrecision::Fast {
                label += ", fast";
            }
            if fas.len() > 1 {
                label += if fa {
                    ", FA attention"
                } else {
                    ", split attention"
                };
            }
            if prods.len() > 1 {
                label += if pr { ", producers" } else { ", no producers" };
            }
            if blocks.len() > 1 {
                label += &format!(", unpack {}M", ub >> 20);
            }
            let r = (|| -> Result<f64> {
                let mut b = m.bufs(g, p)?;
                let ms = time_ms(g, a.iters.min(5), || {
                    m.forward(g, &mut b, p, 0, true, p - 1)
                })?;
                Ok(ms)
            })();
            let (mm, att) = flops(p);
            let pt = torch
                .iter()
                .find(|v| v["p"].as_u64() == Some(p as u64))
                .and_then(|v| v["ms"].as_f64());
            match r {
                Ok(ms) => {
                    println!(
                        "prefill {label} P {p}: {ms:.2} ms, {:.0} tok/s, {:.1} TFLOP/s, PyTorch bf16 {:?} ms",
                        p as f64 / ms * 1e3,
                        (mm + att) / ms / 1e9,
                        pt
                    );
                    md += &format!(
                        "| {label} | {p} | {ms:.2} | {:.0} | {:.1} | {} | {} |\n",
                        p as f64 / ms * 1e3,
                        (mm + att) / ms / 1e9,
                        pt.map(|x| format!("{x:.2}")).unwrap_or("-".into()),
                        pt.map(|x| format!("{:.2}x", x / ms)).unwrap_or("-".into())
                    );
                }
                Err(e) => println!("prefill {label} P {p}: {e:#}"),
            }
        }
    }
    g.set_quant_prefill_rows(None);
    g.set_attn_prefill_split(dflash_cuda_kernels::ATTN_PREFILL_SPLIT)?;
    g.set_prefill_precision(PrefillPrecision::Exact);
    g.set_attn_prefill_fa(true);
    g.set_prefill_producers(true);
    g.set_unpack_block(dflash_cuda_kernels::UNPACK_VALUES);
    println!("\n{md}");
    if let Some(path) = &a.md {
        std::fs::write(path, &md).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A comma-separated list of `on` / `off` (option `opt`'s value).
fn on_off_list(opt: &str, list: &str) -> Result<Vec<bool>> {
    list.split(',')
        .map(|c| match c.trim() {
            "on" => Ok(true),
            "off" => Ok(false),
            o => Err(anyhow!("{opt} {o}: expected on or off")),
        })
        .collect()
}

fn run_torch_prefill(s: &Shape, ps: &[usize], iters: usize) -> Result<Vec<serde_json::Value>> {
    let p: Vec<String> = ps.iter().map(|c| c.to_string()).collect();
    let mut args = shape_args(s);
    args.extend([("--p", p.join(",")), ("--iters", iters.to_string())]);
    json_list(&run_peer("torch_prefill.py", &args)?, "torch_prefill.py")
}

/// A shape's options of the PyTorch peers (`--hidden` .. `--vocab`).
fn shape_args(s: &Shape) -> Vec<(&'static str, String)> {
    vec![
        ("--hidden", s.hidden.to_string()),
        ("--layers", s.layers.to_string()),
        ("--heads", s.heads.to_string()),
        ("--kv-heads", s.kv_heads.to_string()),
        ("--head-dim", s.head_dim.to_string()),
        ("--inter", s.inter.to_string()),
        ("--vocab", s.vocab.to_string()),
    ]
}

/// Run the PyTorch peer `tools/bench/<name>` (from the working directory, else from the
/// repository) with `args` (option, value); its stdout.
fn run_peer(name: &str, args: &[(&str, String)]) -> Result<String> {
    let rel = PathBuf::from("tools/bench").join(name);
    let script = if rel.exists() {
        rel
    } else {
        crate::repo_root().join(rel)
    };
    let out = Command::new(crate::python())
        .arg(&script)
        .args(args.iter().flat_map(|(k, v)| [*k, v.as_str()]))
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The last line of a peer's stdout that is a JSON list.
fn json_list(text: &str, name: &str) -> Result<Vec<serde_json::Value>> {
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .ok_or_else(|| anyhow!("no JSON line from {name}"))?;
    Ok(serde_json::from_str(line)?)
}

fn time_ms(g: &Cuda, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    time_events(g, iters, 1, f)
}

/// Median over `runs` of the device-event time of `per_run` calls of `f` enqueued back to
/// back, divided by `per_run` (after 3 warm-up calls).
fn time_events(
    g: &Cuda,
    runs: usize,
    per_run: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let ctx = g.context();
    let st = g.stream();
    for _ in 0..3 {
        f()?;
    }
    st.synchronize()?;
    let mut ts = Vec::with_capacity(runs);
    for _ in 0..runs {
        let e0 = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let e1 = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        e0.record(st)?;
        for _ in 0..per_run {
            f()?;
        }
        e1.record(st)?;
        e1.synchronize()?;
        ts.push(e0.elapsed_ms(&e1)? as f64 / per_run as f64);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2])
}

struct StepTimes {
    eager: f64,
    graph: Option<f64>,
    graph_err: Option<String>,
}

#[allow(clippy::too_many_arguments)]
fn time_forward(
    g: &Cuda,
    m: &mut Model,
    b: &mut Bufs,
    rows: usize,
    ctx: usize,
    causal: bool,
    lm_from: usize,
    iters: usize,
) -> Result<StepTimes> {
    let eager = time_ms(g, iters, || m.forward(g, b, rows, ctx, causal, lm_from))?;
    let st = g.stream().clone();
    let cap = (|| -> Result<Option<cudarc::driver::CudaGraph>> {
        st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        let r = m.forward(g, b, rows, ctx, causal, lm_from);
        let gr = st.end_capture(CUgraphInstantiate_flags(0));
        r?;
        Ok(gr?)
    })();
    let (graph, graph_err) = match cap {
        Ok(Some(gr)) => (Some(time_ms(g, iters, || Ok(gr.launch()?))?), None),
        Ok(None) => (None, Some("empty capture".to_string())),
        Err(e) => (None, Some(format!("{e:#}"))),
    };
    Ok(StepTimes {
        eager,
        graph,
        graph_err,
    })
}

/// Device-to-device copy bandwidth, bytes read + written per second (median of 20).
fn copy_bandwidth(g: &Cuda) -> Result<f64> {
    let n = 1usize << 30; // 4 GiB of f32 each way... 1 Gi floats = 4 GiB
    let src = g.random_buf(n, 7, 1.0)?;
    let mut dst = g.zeros(n)?;
    let ms = time_ms(g, 20, || Ok(g.copy(&src, 0, &mut dst, 0, n)?))?;
    let raw = {
        let st = g.stream();
        time_ms(g, 20, || Ok(st.memcpy_dtod(src.slice(), dst.slice_mut())?))?
    };
    let best = ms.min(raw);
    println!(
        "copy bandwidth: kernel copy {:.0} GB/s, cuMemcpyDtoD {:.0} GB/s (read + write, 4 GiB)",
        2.0 * 4.0 * n as f64 / ms / 1e6,
        2.0 * 4.0 * n as f64 / raw / 1e6
    );
    Ok(2.0 * 4.0 * n as f64 / best / 1e6 * 1e9)
}

fn run_torch(s: &Shape, ctxs: &[usize], iters: usize) -> Result<Vec<serde_json::Value>> {
    let windows: Vec<String> = s
        .windows
        .iter()
        .map(|w| w.map(|x| x.to_string()).unwrap_or_else(|| "none".into()))
        .collect();
    let ctx: Vec<String> = ctxs.iter().map(|c| c.to_string()).collect();
    let mut args = shape_args(s);
    args.extend([
        ("--block", s.block.to_string()),
        ("--windows", windows.join(",")),
        ("--ctx", ctx.join(",")),
        ("--iters", iters.to_string()),
        ("--name", s.name.to_string()),
    ]);
    run_peer("torch_drafter.py", &args)?
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| {
            serde_json::from_str(l).map_err(|e| anyhow!("bad JSON from torch_drafter.py: {e}: {l}"))
        })
        .collect()
}

fn fmt_name(f: WeightFormat) -> &'static str {
    match f {
        WeightFormat::F32 => "f32",
        WeightFormat::Bf16 => "bf16",
        WeightFormat::F16 => "f16",
        WeightFormat::Q8_0 => "q8_0",
        WeightFormat::Q4_0 => "q4_0",
        WeightFormat::Q8_0A8 => "q8_0a8",
        WeightFormat::Q4_0A8 => "q4_0a8",
    }
}

/// The K / V storage `--kv16` asks for.
fn kv_arg(a: &BenchArgs) -> KvStorage {
    if a.kv16 {
        KvStorage::F16
    } else {
        KvStorage::F32
    }
}

/// A drafter variant's name in the tables: the weight format, with `+ fast attn` when its
/// attention runs through `attention_fast`, `+ fast attn, f16 KV` through
/// `attention_fast_kv16` over an f16 cache.
fn variant_name(f: WeightFormat, fast: bool, kv: KvStorage) -> String {
    match (fast, kv) {
        (_, KvStorage::F16) => format!("{} + fast attn, f16 KV", fmt_name(f)),
        (true, KvStorage::F32) => format!("{} + fast attn", fmt_name(f)),
        (false, KvStorage::F32) => fmt_name(f).to_string(),
    }
}

fn parse_attn_kernel(name: &str) -> Result<AttnKernel> {
    // auto, simt, or tc{2|4}[f][r{1|2|4}][s{1|2|3}]: key warps, P V on the CUDA cores, row
    // warps and pipeline stages (0 = the automatic choice).
    let bad = || anyhow!("--attn-kernel {name}: expected auto, simt or tc{{2|4}}[f][rN][sN]");
    Ok(match name {
        "auto" => AttnKernel::Auto,
        "simt" => AttnKernel::Simt,
        _ => {
            let rest = name.strip_prefix("tc").ok_or_else(bad)?;
            let (kw, mut rest) = rest.split_at(rest.len().min(1));
            let key_warps: usize = kw.parse().map_err(|_| bad())?;
            let ffma_pv = rest.starts_with('f');
            if ffma_pv {
                rest = &rest[1..];
            }
            let (mut row_warps, mut stages) = (0, 0);
            while let Some(c) = rest.chars().next() {
                let digits: String = rest[1..]
                    .chars()
                    .take_while(|d| d.is_ascii_digit())
                    .collect();
                let n: usize = digits.parse().map_err(|_| bad())?;
                match c {
                    'r' => row_warps = n,
                    's' => stages = n,
                    _ => return Err(bad()),
                }
                rest = &rest[1 + digits.len()..];
            }
            AttnKernel::Tc {
                key_warps,
                row_warps,
                ffma_pv,
                stages,
            }
        }
    })
}

/// Per-op times at the 8B drafter shape: achieved bandwidth of each matmul and attention.
/// Q8_0A8 kernel choices timed in the per-op table (all give the same bits).
/// Q8_0A8 kernel choices timed in the per-op table (kernel, programmatic dependent launch;
/// all give the same bits).
const A8_VARIANTS: &[(A8Kernel, bool, &str)] = &[
    (A8Kernel::Auto, true, " auto (default, PDL)"),
    (A8Kernel::Auto, false, " auto without PDL"),
    (A8Kernel::WholeK, false, " whole-K"),
    (
        A8Kernel::SplitApart(4, 2, 2),
        false,
        " split apart w4 k2 s2",
    ),
    (A8Kernel::Split(1, 4, 3), false, " split w1 k4 s3"),
    (A8Kernel::Split(2, 4, 3), false, " split w2 k4 s3"),
    (A8Kernel::Split(4, 1, 3), false, " split w4 k1 s3"),
    (A8Kernel::Split(4, 2, 3), false, " split w4 k2 s3"),
    (A8Kernel::Split(4, 2, 2), false, " split w4 k2 s2"),
];

/// Extra Q8_0A8 shapes of the 27B drafter (hidden 5120, intermediate 17408).
const SHAPES_27B: [(usize, usize, &str); 3] = [
    (5120, 5120, "27B 5120x5120"),
    (17408, 5120, "27B gate/up 17408x5120"),
    (5120, 17408, "27B down 5120x17408"),
];

fn parse_a8_kernel(s: &str) -> Result<A8Kernel> {
    Ok(match s {
        "auto" => A8Kernel::Auto,
        "whole" => A8Kernel::WholeK,
        o if o.starts_with("split") || o.starts_with("apart") => {
            // splitWxKSsS, e.g. split4x2s3: w tiles, ks slices, s pipeline stages; apartWxKSsS:
            // the same with K also split across blocks.
            let spec = &o["split".len()..];
            let (w, rest) = spec
                .split_once('x')
                .ok_or_else(|| anyhow!("--a8-kernel {o}"))?;
            let (ks, st) = rest
                .split_once('s')
                .ok_or_else(|| anyhow!("--a8-kernel {o}"))?;
            let (w, ks, st) = (w.parse()?, ks.parse()?, st.parse()?);
            if o.starts_with("split") {
                A8Kernel::Split(w, ks, st)
            } else {
                A8Kernel::SplitApart(w, ks, st)
            }
        }
        o => bail!(
            "--a8-kernel {o}: expected auto, whole, splitWxKSsS (e.g. split4x2s3) or apartWxKSsS"
        ),
    })
}

/// The norm -> q/k/v chain at the 8B shape, 16 rows, as graphs of 10 instances (each with its
/// own q/k/v weight copy, 267 MB in all): us per instance of each variant, two rounds.
fn norm_chain(g: &Cuda, iters: usize) -> Result<()> {
    let (rows, k, eps) = (16usize, 4096usize, 1e-6f32);
    let ns = [4096usize, 1024, 1024];
    let copies: Vec<Vec<Weight<Cuda>>> = (0..10)
        .map(|c| {
            ns.iter()
                .map(|&n| g.random_weight("w", n, k, WeightFormat::Q8_0A8, 20 + c, 0.02))
                .collect::<std::result::Result<Vec<_>, _>>()
        })
        .collect::<std::result::Result<_, _>>()?;
    let h = g.random_buf(rows * k, 3, 1.0)?;
    let mut h2 = g.random_buf(rows * k, 4, 1.0)?;
    let o = g.random_buf(rows * k, 5, 1.0)?;
    let nw = ones(g, k)?;
    let mut x = g.zeros(rows * k)?;
    let mut outs: Vec<CudaBuf> = ns
        .iter()
        .map(|&n| g.zeros(rows * n))
        .collect::<std::result::Result<_, _>>()?;
    type Variant<'a> = (
        &'a str,
        Box<dyn Fn(&mut CudaBuf, &mut [CudaBuf], &mut CudaBuf) -> Result<()> + 'a>,
    );
    let variants: Vec<Variant> = vec![
        (
            "rms_norm x10",
            Box::new(|x: &mut CudaBuf, _: &mut [CudaBuf], _: &mut CudaBuf| {
                for _ in 0..10 {
                    g.rms_norm(&h, &nw, k, eps, x)?;
                }
                Ok(())
            }),
        ),
        (
            "add_rms_norm x10",
            Box::new(|x: &mut CudaBuf, _: &mut [CudaBuf], h2: &mut CudaBuf| {
                for _ in 0..10 {
                    g.add_rms_norm(h2, &o, &nw, rows, k, eps, x)?;
                }
                Ok(())
            }),
        ),
        (
            "rms_norm_q8 x10",
            Box::new(|_: &mut CudaBuf, _: &mut [CudaBuf], _: &mut CudaBuf| {
                for _ in 0..10 {
                    g.rms_norm_q8(&h, 0, rows, &nw, k, eps)?;
                }
                Ok(())
            }),
        ),
        (
            "quantizer + q/k/v x10",
            Box::new(|x: &mut CudaBuf, outs: &mut [CudaBuf], _: &mut CudaBuf| {
                for c in &copies {
                    let wr: Vec<&Weight<Cuda>> = c.iter().collect();
                    let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                    g.matmul_many(x, rows, &wr, &mut refs)?;
                }
                Ok(())
            }),
        ),
        (
            "q/k/v of a ready activation x10",
            Box::new(|_: &mut CudaBuf, outs: &mut [CudaBuf], _: &mut CudaBuf| {
                let act = g.rms_norm_q8(&h, 0, rows, &nw, k, eps)?;
                for c in &copies {
                    let wr: Vec<&Weight<Cuda>> = c.iter().collect();
                    let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                    g.matmul_many_q8(&act, &wr, &mut refs, false)?;
                }
                Ok(())
            }),
        ),
        (
            "(rms_norm + quantizer + q/k/v) x10",
            Box::new(|x: &mut CudaBuf, outs: &mut [CudaBuf], _: &mut CudaBuf| {
                for c in &copies {
                    g.rms_norm(&h, &nw, k, eps, x)?;
                    let wr: Vec<&Weight<Cuda>> = c.iter().collect();
                    let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                    g.matmul_many(x, rows, &wr, &mut refs)?;
                }
                Ok(())
            }),
        ),
        (
            "(add_rms_norm + quantizer + q/k/v) x10",
            Box::new(|x: &mut CudaBuf, outs: &mut [CudaBuf], h2: &mut CudaBuf| {
                for c in &copies {
                    g.add_rms_norm(h2, &o, &nw, rows, k, eps, x)?;
                    let wr: Vec<&Weight<Cuda>> = c.iter().collect();
                    let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                    g.matmul_many(x, rows, &wr, &mut refs)?;
                }
                Ok(())
            }),
        ),
        (
            "(rms_norm_q8 + q/k/v) x10",
            Box::new(|_: &mut CudaBuf, outs: &mut [CudaBuf], _: &mut CudaBuf| {
                for c in &copies {
                    let act = g.rms_norm_q8(&h, 0, rows, &nw, k, eps)?;
                    let wr: Vec<&Weight<Cuda>> = c.iter().collect();
                    let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                    g.matmul_many_q8(&act, &wr, &mut refs, false)?;
                }
                Ok(())
            }),
        ),
    ];
    println!("| chain (8B q/k/v, 16 rows) | us per instance round 1 | round 2 |\n|---|---:|---:|");
    let mut t = vec![Vec::new(); variants.len()];
    for _round in 0..2 {
        for (i, (_, f)) in variants.iter().enumerate() {
            let ms = time_graph(g, iters, || f(&mut x, &mut outs, &mut h2))?;
            t[i].push(ms * 100.0);
        }
    }
    for ((name, _), v) in variants.iter().zip(&t) {
        println!("| {name} | {:.2} | {:.2} |", v[0], v[1]);
    }
    Ok(())
}

/// One projection (`matmul_many` of the matrices `ns` x `k`, as the step issues it) over
/// `copies` distinct copies of its weights (so that they stream from HBM, not L2), for
/// `--a8-probe` and `--a8-sweep`.
struct ProjCopies {
    ws: Vec<Vec<Weight<Cuda>>>,
    x: CudaBuf,
    outs: Vec<CudaBuf>,
    rows: usize,
    /// Weight bytes of one copy.
    bytes: usize,
}

impl ProjCopies {
    fn new(
        g: &Cuda,
        ns: &[usize],
        k: usize,
        f: WeightFormat,
        rows: usize,
        copies: usize,
        seed: u64,
    ) -> Result<Self> {
        let ws: Vec<Vec<Weight<Cuda>>> = (0..copies.max(1))
            .map(|c| {
                ns.iter()
                    .map(|&n| g.random_weight("w", n, k, f, seed + c as u64, 0.02))
                    .collect::<std::result::Result<Vec<_>, _>>()
            })
            .collect::<std::result::Result<_, _>>()?;
        let bytes = ws[0].iter().map(|w| w.buf.device_bytes()).sum();
        let x = g.random_buf(rows * k, 3, 1.0)?;
        let outs = ns
            .iter()
            .map(|&n| g.zeros(rows * n))
            .collect::<std::result::Result<_, _>>()?;
        Ok(ProjCopies {
            ws,
            x,
            outs,
            rows,
            bytes,
        })
    }

    /// ms per launch: a graph of one launch per copy, replayed (time_graph's median).
    fn time(&mut self, g: &Cuda, iters: usize) -> Result<f64> {
        let ProjCopies {
            ws, x, outs, rows, ..
        } = self;
        let ms = time_graph(g, iters, || {
            for c in ws.iter() {
                let wr: Vec<&Weight<Cuda>> = c.iter().collect();
                let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                g.matmul_many(x, *rows, &wr, &mut refs)?;
            }
            Ok(())
        })?;
        Ok(ms / ws.len() as f64)
    }
}

/// `--a8-probe`: the 8B step's A8 projections alone, 16 rows, each launch over its own copy
/// of the weights (copies x bytes > 2x the L2, so the weights come from HBM).
fn a8_probe(g: &Cuda, bw: f64, iters: usize, which: &str) -> Result<String> {
    let wanted = |name: &str, f: WeightFormat| {
        which == "all"
            || which.split(',').any(|w| {
                let (n, q) = w.trim().split_once(':').unwrap_or((w.trim(), ""));
                n == name
                    && match q {
                        "q8" => f == WeightFormat::Q8_0A8,
                        "q4" => f == WeightFormat::Q4_0A8,
                        _ => true,
                    }
            })
    };
    let rows = 16usize;
    let mut md = format!(
        "\n### A8 matmuls alone (16 rows, distinct weight copies; copy bandwidth {:.0} GB/s)\n\n| launch | format | us | GB/s | % of copy bw |\n|---|---|---:|---:|---:|\n",
        bw / 1e9
    );
    let launches: [(&str, &[usize], usize); 5] = [
        ("q/k/v", &[4096, 1024, 1024], 4096),
        ("o", &[4096], 4096),
        ("gate/up", &[12288, 12288], 4096),
        ("down", &[4096], 12288),
        ("lm_head", &[151936], 4096),
    ];
    for (name, ns, k) in launches {
        for f in [WeightFormat::Q8_0A8, WeightFormat::Q4_0A8] {
            if !wanted(name, f) {
                continue;
            }
            let per_copy: usize = ns.iter().map(|&n| n * k).sum();
            let copies = (240_000_000 / per_copy).clamp(1, 16);
            let mut p = ProjCopies::new(g, ns, k, f, rows, copies, 30)?;
            let ms = p.time(g, iters)?;
            let gbs = p.bytes as f64 / ms / 1e6;
            md += &format!(
                "| {name} | {} | {:.1} | {gbs:.0} | {:.0}% |\n",
                fmt_name(f),
                ms * 1e3,
                100.0 * gbs * 1e9 / bw
            );
        }
    }
    Ok(md)
}

fn op_breakdown(g: &Cuda, bw: f64, iters: usize) -> Result<String> {
    let mut md = String::from("\n### Per-op times (8B drafter shapes, CUDA graph of 1 op replayed; GB/s = weight or K/V bytes / time)\n\n| op | rows | ms | GB/s | % of copy bw |\n|---|---:|---:|---:|---:|\n");
    let shapes = [
        (4096usize, 4096usize, "q/o proj 4096x4096"),
        (1024, 4096, "k/v proj 1024x4096"),
        (12288, 4096, "gate/up 12288x4096"),
        (4096, 12288, "down 4096x12288"),
        (151936, 4096, "lm_head 151936x4096"),
    ];
    for f in [
        WeightFormat::Bf16,
        WeightFormat::Q8_0,
        WeightFormat::Q8_0A8,
        WeightFormat::Q4_0,
        WeightFormat::Q4_0A8,
    ] {
        // Q8_0A8, Q4_0A8: every kernel choice (same bits).
        let kernels: &[(A8Kernel, bool, &str)] = if f.is_a8() {
            A8_VARIANTS
        } else {
            &[(A8Kernel::Auto, false, "")]
        };
        let mut all_shapes = shapes.to_vec();
        if f.is_a8() {
            all_shapes.extend(SHAPES_27B);
        }
        for &(n, k, name) in &all_shapes {
            let w = g.random_weight("w", n, k, f, 9, 0.02)?;
            for &(kern, pdl, kname) in kernels {
                g.set_a8_kernel(kern);
                g.set_a8_pdl(pdl);
                for rows in [1usize, 16] {
                    let x = g.random_buf(rows * k, 3, 1.0)?;
                    let mut o = g.zeros(rows * n)?;
                    let ms = time_graph(g, iters, || Ok(g.matmul(&x, rows, &w, &mut o)?))?;
                    let gbs = w.buf.device_bytes() as f64 / ms / 1e6;
                    md += &format!(
                        "| matmul {}{kname} {name} | {rows} | {ms:.4} | {gbs:.0} | {:.0}% |\n",
                        fmt_name(f),
                        100.0 * gbs * 1e9 / bw
                    );
                }
            }
            g.set_a8_kernel(A8Kernel::Auto);
            g.set_a8_pdl(true);
        }
    }
    // The step's fused launches (Q8_0A8 / Q4_0A8 `matmul_many`: one x quantization + one
    // launch).
    for (f, (ns, k, name)) in [WeightFormat::Q8_0A8, WeightFormat::Q4_0A8]
        .into_iter()
        .flat_map(|f| {
            [
                (
                    vec![4096usize, 1024, 1024],
                    4096usize,
                    "q/k/v 4096+1024+1024 x4096",
                ),
                (vec![12288, 12288], 4096, "gate/up 2x12288 x4096"),
                (vec![17408, 17408], 5120, "27B gate/up 2x17408 x5120"),
            ]
            .into_iter()
            .map(move |c| (f, c))
        })
    {
        let ws: Vec<_> = ns
            .iter()
            .map(|&n| g.random_weight("w", n, k, f, 9, 0.02))
            .collect::<std::result::Result<_, _>>()?;
        let wr: Vec<_> = ws.iter().collect();
        let bytes: usize = ws.iter().map(|w| w.buf.device_bytes()).sum();
        for &(kern, pdl, kname) in A8_VARIANTS {
            g.set_a8_kernel(kern);
            g.set_a8_pdl(pdl);
            for rows in [1usize, 16] {
                let x = g.random_buf(rows * k, 3, 1.0)?;
                let mut outs: Vec<CudaBuf> = ns
                    .iter()
                    .map(|&n| g.zeros(rows * n))
                    .collect::<std::result::Result<_, _>>()?;
                let ms = time_graph(g, iters, || {
                    let mut refs: Vec<&mut CudaBuf> = outs.iter_mut().collect();
                    Ok(g.matmul_many(&x, rows, &wr, &mut refs)?)
                })?;
                let gbs = bytes as f64 / ms / 1e6;
                md += &format!(
                    "| matmul_many {}{kname} {name} | {rows} | {ms:.4} | {gbs:.0} | {:.0}% |\n",
                    fmt_name(f),
                    100.0 * gbs * 1e9 / bw
                );
            }
        }
        g.set_a8_kernel(A8Kernel::Auto);
        g.set_a8_pdl(true);
    }
    // Attention: the f32 SIMT kernel (split 256) and the 3xTF32 tensor-core kernel with 2 / 4
    // key warps per chunk over split sizes, row warps chosen from the grid (auto) or forced
    // ("win" = sliding window: only the visible keys counted). P V on the CUDA cores (tc2f /
    // tc4f) is left out: measured slower everywhere. Registers and spills of the kernels first.
    for (name, regs, local) in g.attn_kernel_info()? {
        let row = format!(
            "attention kernel {name}: {regs} registers, {local} bytes local memory per thread\n"
        );
        print!("{row}");
        md += &row;
    }
    let tc = |key_warps, row_warps, stages| AttnKernel::Tc {
        key_warps,
        row_warps,
        ffma_pv: false,
        stages,
    };
    let mut v: Vec<(AttnKernel, usize, String)> = vec![
        (AttnKernel::Simt, 256, "simt split 256".into()),
        (AttnKernel::Auto, 256, "auto (default) split 256".into()),
    ];
    for kw in [2usize, 4] {
        for split in [128usize, 256, 512] {
            v.push((tc(kw, 0, 0), split, format!("tc kw{kw} split {split}")));
        }
    }
    // Row warps x pipeline stages (neither changes a bit); 0 = chosen from the grid.
    for kw in [2usize, 4] {
        for rw in [1usize, 2, 4] {
            for st in [1usize, 2, 3] {
                v.push((
                    tc(kw, rw, st),
                    256,
                    format!("tc kw{kw} rw{rw} stages {st} split 256"),
                ));
            }
        }
    }
    let groups = vec![v];
    for attn_variants in &groups {
        for (ctx, nq, causal, window) in [
            (512usize, 16usize, false, None),
            (512, 1, true, None),
            (2048, 16, false, None),
            (8192, 16, false, None),
            (8192, 1, true, None),
            (8192, 16, false, Some(2048usize)),
        ] {
            let (h, hkv, hd) = (32usize, 8usize, 128usize);
            let q = g.random_buf(nq * h * hd, 4, 1.0)?;
            let kc = g.random_buf((ctx + 16) * hkv * hd, 5, 1.0)?;
            let vc = g.random_buf((ctx + 16) * hkv * hd, 6, 1.0)?;
            let mut o = g.zeros(nq * h * hd)?;
            let p = AttnParams {
                n_q: nq,
                n_kv: ctx + nq,
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: hd,
                q_pos0: ctx,
                kv_pos0: 0,
                causal,
                window,
                scale: 0.088,
            };
            let wname = window.map(|w| format!(" win {w}")).unwrap_or_default();
            for (kern, split, name) in attn_variants {
                g.set_attn_kernel(*kern)?;
                g.set_attn_split(*split)?;
                let ms = time_graph(g, iters, || Ok(g.attention(&q, &kc, &vc, &p, &mut o)?))?;
                let keys = window.map_or(ctx + nq, |w| (w + nq).min(ctx + nq));
                let bytes = 2 * keys * hkv * hd * 4;
                let gbs = bytes as f64 / ms / 1e6;
                let row = format!(
                    "| attention ctx {ctx}{wname} 32/8 heads d128, {name} | {nq} | {ms:.4} | {gbs:.0} | {:.0}% |\n",
                    100.0 * gbs * 1e9 / bw
                );
                print!("{row}");
                md += &row;
            }
            g.set_attn_kernel(AttnKernel::Auto)?;
            g.set_attn_split_auto();
        }
    }
    for (rows, dim) in [(16usize, 4096usize), (512, 128)] {
        let x = g.random_buf(rows * dim, 4, 1.0)?;
        let w = g.random_buf(dim, 5, 1.0)?;
        let mut o = g.zeros(rows * dim)?;
        let ms = time_graph(g, iters, || Ok(g.rms_norm(&x, &w, dim, 1e-6, &mut o)?))?;
        md += &format!("| rms_norm dim {dim} | {rows} | {ms:.4} | - | - |\n");
    }
    Ok(md)
}

/// `default`, `nofa` (the FA kernel off), `faall` (on every f16-cache call), `fabN` (long
/// spans, splits for N blocks per SM) or `nowg` (the mma.sync FA kernel, not its wgmma twin);
/// `+`-joined (`nowg+fab2`).
fn parse_attn_fa(name: &str) -> Result<AttnFa> {
    let mut fa = AttnFa::default();
    for part in name.split('+') {
        match part {
            "default" => {}
            "nofa" => fa.long = false,
            "faall" => fa.all = true,
            "nowg" => fa.wgmma = false,
            n => {
                fa.blocks_per_sm = n
                    .strip_prefix("fab")
                    .ok_or_else(|| {
                        anyhow!("--attn-fa {n}: expected default, nofa, faall, nowg or fabN")
                    })?
                    .parse()?
            }
        }
    }
    Ok(fa)
}

/// Median ms of a CUDA graph holding what `f` queues (captured once after warm-up).
fn time_graph(g: &Cuda, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    g.stream().synchronize()?;
    let st = g.stream().clone();
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let r = f();
    let gr = st.end_capture(CUgraphInstantiate_flags(0));
    r?;
    let gr = gr?.ok_or_else(|| anyhow!("empty capture"))?;
    if B2B.load(std::sync::atomic::Ordering::Relaxed) {
        // Mean ms per replay of `iters` replays enqueued back to back, median of 5 such runs.
        return time_events(g, 5, iters, || Ok(gr.launch()?));
    }
    time_ms(g, iters, || Ok(gr.launch()?))
}

/// An `on` / `off` flag's value.
fn on_off(flag: &str, v: &str) -> Result<bool> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        o => bail!("{flag} {o}: expected on or off"),
    }
}

/// `--b2b`: time graph replays back to back.
static B2B: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn bench(a: BenchArgs) -> Result<()> {
    let opts = dflash_cuda_kernels::CudaOptions {
        block_trace: a.trace.is_some() || a.trace_target.is_some(),
        ..Default::default()
    };
    let g = Cuda::with_options(0, opts).map_err(|e| anyhow!("no usable CUDA device: {e}"))?;
    let carveout = match &a.carveout {
        Some(c) => parse_carveout(c).context("--carveout")?,
        None => (SMEM_CARVEOUT_A8, SMEM_CARVEOUT_OTHER),
    };
    g.set_smem_carveout(carveout.0, carveout.1)?;
    g.warm_up()?;
    B2B.store(a.b2b, std::sync::atomic::Ordering::Relaxed);
    let a8k = parse_a8_kernel(&a.a8_kernel)?;
    g.set_a8_pdl(on_off("--a8-pdl", &a.a8_pdl)?);
    g.set_skinny_pdl(on_off("--skinny-pdl", &a.skinny_pdl)?);
    g.set_skinny_glu(on_off("--skinny-glu", &a.skinny_glu)?);
    g.set_skinny_producers(!a.no_skinny_producers);
    g.set_attn_fa(parse_attn_fa(&a.attn_fa)?)?;
    if let Some(table) = &a.attn_causal {
        let parsed = table
            .split(',')
            .map(|e| {
                let (k0, sk) = e
                    .split_once(':')
                    .ok_or_else(|| anyhow!("--attn-causal {e}: expected KEYS:SPLIT"))?;
                Ok((k0.trim().parse::<usize>()?, sk.trim().parse::<usize>()?))
            })
            .collect::<Result<Vec<_>>>()?;
        g.set_attn_causal_splits(&parsed)?;
    }

    if let Some(ctx) = a.attn_once {
        // One attention shape, a few calls, nothing else (for a profiler).
        g.set_attn_kernel(parse_attn_kernel(&a.attn_kernel)?)?;
        set_split(&g, a.attn_split)?;
        let (nq, h, hkv, hd) = (16usize, 32usize, 8usize, 128usize);
        let q = g.random_buf(nq * h * hd, 4, 1.0)?;
        let kc = g.random_buf((ctx + nq) * hkv * hd, 5, 1.0)?;
        let vc = g.random_buf((ctx + nq) * hkv * hd, 6, 1.0)?;
        let mut o = g.zeros(nq * h * hd)?;
        let p = AttnParams {
            n_q: nq,
            n_kv: ctx + nq,
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: hd,
            q_pos0: ctx,
            kv_pos0: 0,
            causal: false,
            window: None,
            scale: 0.088,
        };
        // --kv16: the caches packed to f16, through attention_fast_kv16.
        let kv16 = if a.kv16 {
            let n = (ctx + nq) * hkv * hd;
            let (mut k16, mut v16) = (g.zeros(n / 2)?, g.zeros(n / 2)?);
            g.f16_pack(&kc, &mut k16, 0, n)?;
            g.f16_pack(&vc, &mut v16, 0, n)?;
            Some((k16, v16))
        } else {
            None
        };
        if let (Some(list), Some((k16, v16))) = (&a.fa_sweep, &kv16) {
            let bw = copy_bandwidth(&g)?;
            let bytes = 2 * (ctx + nq) * hkv * hd * 2;
            println!("| attention_fast_kv16 ctx {ctx}, 16 x 32 / 8 heads d128 | us per call | K / V GB/s | % of copy bw |\n|---|---:|---:|---:|");
            for _round in 0..2 {
                for c in list.split(',') {
                    let (name, st) = c.split_once(":s").unwrap_or((c, "0"));
                    g.set_attn_fa(parse_attn_fa(name)?)?;
                    g.set_attn_kernel(AttnKernel::Tc {
                        key_warps: 4,
                        row_warps: 0,
                        ffma_pv: false,
                        stages: st.parse()?,
                    })?;
                    let ms = time_graph(&g, a.iters, || {
                        for _ in 0..20 {
                            g.attention_fast_kv16(&q, k16, v16, &p, &mut o)?;
                        }
                        Ok(())
                    })? / 20.0;
                    let gbs = bytes as f64 / ms / 1e6;
                    println!(
                        "| {c} | {:.2} | {gbs:.0} | {:.0}% |",
                        ms * 1e3,
                        100.0 * gbs * 1e9 / bw
                    );
                }
            }
            g.set_attn_fa(AttnFa::default())?;
            g.set_attn_kernel(AttnKernel::Auto)?;
            return Ok(());
        }
        for _ in 0..3 {
            if let Some((k16, v16)) = &kv16 {
                g.attention_fast_kv16(&q, k16, v16, &p, &mut o)?;
            } else if a.attn_fast {
                g.attention_fast(&q, &kc, &vc, &p, &mut o)?;
            } else {
                g.attention(&q, &kc, &vc, &p, &mut o)?;
            }
        }
        g.synchronize()?;
        if let Some(path) = &a.attn_dump {
            let v = g.download(&o)?;
            std::fs::write(path, bytemuck::cast_slice::<f32, u8>(&v))
                .with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    if a.norm_chain {
        g.set_a8_pdl(a.a8_pdl != "off");
        return norm_chain(&g, a.iters);
    }
    if let Some(which) = &a.a8_probe {
        let bw = copy_bandwidth(&g)?;
        println!("{}", a8_probe(&g, bw, a.iters, which)?);
        return Ok(());
    }
    if a.ops_only {
        let bw = copy_bandwidth(&g)?;
        println!("{}", op_breakdown(&g, bw, a.iters)?);
        return Ok(());
    }
    let dev_name = g.context().name()?;
    let ctxs: Vec<usize> = a
        .ctx
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()?;
    let shapes: Vec<Shape> = a
        .shapes
        .split(',')
        .map(|s| shape(s.trim()))
        .collect::<Result<_>>()?;
    // (format, attention through attention_fast, K / V storage)
    let fmts: Vec<(WeightFormat, bool, KvStorage)> = a
        .formats
        .split(',')
        .map(|s| {
            let s = s.trim();
            Ok(if let Some(f) = s.strip_suffix("+fa16") {
                (parse_format(f)?, true, KvStorage::F16)
            } else if let Some(f) = s.strip_suffix("+fa") {
                (parse_format(f)?, true, KvStorage::F32)
            } else {
                (parse_format(s)?, false, KvStorage::F32)
            })
        })
        .collect::<Result<_>>()?;
    if let Some(list) = &a.prefill {
        return prefill(&g, &a, list);
    }
    if let Some(list) = &a.recurrent {
        return hybrid::recurrent(&g, &a, list);
    }
    if let Some(list) = &a.hybrid {
        return hybrid::hybrid_target(&g, &a, list);
    }
    if let Some(list) = &a.a8_sweep {
        return a8_sweep(&g, &a, list, &shapes, &ctxs);
    }
    if let Some(filter) = &a.kernel_info {
        println!("| module | kernel | registers | local bytes |\n|---|---|---:|---:|");
        for (k, regs, local) in g.kernel_info(filter)? {
            println!(
                "| {} | {} | {regs} | {local} |",
                k.module().name(),
                k.name()
            );
        }
        return Ok(());
    }
    if let Some(path) = &a.trace {
        return block_trace(&g, &a, &shapes, &ctxs, path);
    }
    if let Some(path) = &a.trace_target {
        return target_trace(&g, &a, &ctxs, path);
    }
    if a.timeline {
        return timeline(&g, &a, &shapes, &ctxs);
    }
    if a.library {
        return library_step(&g, &a, &shapes, &ctxs);
    }
    let bw = copy_bandwidth(&g)?;
    let mut md = String::new();
    let date = Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    md += &format!("Measured {date} on {dev_name} ({} SMs, {}), copy bandwidth {:.0} GB/s (read + write, 4 GiB device-to-device, median of 20); shared-memory carveouts {}/{} (Q8_0A8 matmuls / other kernels, percent, -1 = the driver's choice).\n\n", g.num_sms(), g.arch(), bw / 1e9, carveout.0, carveout.1);

    let ops_md = if a.no_ops {
        String::new()
    } else {
        op_breakdown(&g, bw, a.iters)?
    };
    println!("{ops_md}");

    // Our drafters.
    struct Row {
        shape: &'static str,
        fmt: WeightFormat,
        fast: bool,
        kv: KvStorage,
        ctx: usize,
        t: StepTimes,
        markov: Option<StepTimes>,
        floor_ms: f64,
        bytes: usize,
    }
    let mut rows = Vec::new();
    for s in &shapes {
        let cap = ctxs.iter().max().copied().unwrap_or(512) + s.block;
        g.set_a8_kernel(a8k);
        set_split(&g, a.attn_split)?;
        g.set_attn_kernel(parse_attn_kernel(&a.attn_kernel)?)?;
        g.set_markov_mma(!a.markov_lanes);
        for &(f, fast, kv) in &fmts {
            let mut m = Model::new(&g, s, f, cap, false, 42)?;
            m.base_kernel = a8k;
            m.fast_attn = fast;
            m.set_kv(&g, kv)?;
            m.fused = !a.unfused;
            m.attn_tail = !a.separate_attn_tail;
            m.q8norm = !a.no_a8_producers;
            m.prefetch = parse_prefetch(&a.l2_prefetch)?;
            let mut b = m.bufs(&g, s.block)?;
            for &ctx in &ctxs {
                let t = time_forward(&g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)?;
                let bytes = m.floor_bytes(s.block, ctx);
                let floor_ms = bytes as f64 / bw * 1e3;
                println!(
                    "{} {:>5} ctx {:>5}: eager {:.3} ms, graph {} ms, floor {:.3} ms ({:.2} GB){}",
                    s.name,
                    variant_name(f, fast, kv),
                    ctx,
                    t.eager,
                    t.graph.map(|x| format!("{x:.3}")).unwrap_or("-".into()),
                    floor_ms,
                    bytes as f64 / 1e9,
                    t.graph_err
                        .as_ref()
                        .map(|e| format!(" (graph: {e})"))
                        .unwrap_or_default()
                );
                rows.push(Row {
                    shape: s.name,
                    fmt: f,
                    fast,
                    kv,
                    ctx,
                    t,
                    markov: None,
                    floor_ms,
                    bytes,
                });
            }
            if a.markov {
                let n = rows.len();
                // No Markov kernel reads Q4_0A8 (the loader keeps the head in bf16 / f32): its
                // rows run the head in q4_0, the same bytes.
                let mf = if f == WeightFormat::Q4_0A8 {
                    WeightFormat::Q4_0
                } else {
                    f
                };
                let (w1, w2) = (
                    g.random_weight("w1", s.vocab, 256, mf, 77, 1.0)?,
                    g.random_weight("w2", s.vocab, 256, mf, 78, 1.0 / 16.0)?,
                );
                m.markov = Some((w1, w2));
                for (i, &ctx) in ctxs.iter().enumerate() {
                    let t = time_forward(&g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)?;
                    println!(
                        "{} {:>5} ctx {:>5} + Markov r=256: eager {:.3} ms, graph {:?}",
                        s.name,
                        variant_name(f, fast, kv),
                        ctx,
                        t.eager,
                        t.graph
                    );
                    rows[n - ctxs.len() + i].markov = Some(t);
                }
            }
        }
    }

    // Dense target: verify 16 vs decode 1 (Qwen3-8B shape, bf16 and the re-encoded formats).
    let mut target_rows = Vec::new();
    if !a.no_target {
        let s = dense_8b_target()?;
        let cap = ctxs.iter().max().copied().unwrap_or(512) + 16;
        for entry in a.target_formats.split(',') {
            let (mut m, _, label) = target_model(&g, &s, entry, cap)?;
            m.fused = !a.unfused;
            m.attn_tail = !a.separate_attn_tail;
            m.q8norm = !a.no_a8_producers;
            let mut b16 = m.bufs(&g, 16)?;
            let mut b1 = m.bufs(&g, 1)?;
            if a.profile_target {
                for &ctx in &ctxs {
                    for (rows, b) in [(1, &mut b1), (16, &mut b16)] {
                        for profiled in [false, true] {
                            let prof = profiled.then(cudarc::driver::Profiler::new).transpose()?;
                            m.forward(&g, b, rows, ctx, true, 0)?;
                            g.stream().synchronize()?;
                            drop(prof);
                        }
                    }
                    println!("target {label} ctx {ctx}: a decode1 and a verify16 profiled");
                }
                continue;
            }
            for &ctx in &ctxs {
                let v = time_forward(&g, &mut m, &mut b16, 16, ctx, true, 0, a.iters.min(20))?;
                let d = time_forward(&g, &mut m, &mut b1, 1, ctx, true, 0, a.iters.min(20))?;
                let floor = m.floor_bytes(1, ctx) as f64 / bw * 1e3;
                println!(
                    "target {label} ctx {ctx}: verify16 {:?} decode1 {:?} floor(decode) {floor:.3} ms",
                    v.graph,
                    d.graph
                );
                target_rows.push((label.clone(), ctx, v, d, floor));
            }
        }
    }

    // PyTorch peer.
    let mut torch: Vec<serde_json::Value> = Vec::new();
    if !a.no_torch {
        for s in &shapes {
            match run_torch(s, &ctxs, a.iters) {
                Ok(v) => torch.extend(v),
                Err(e) => println!("PyTorch peer failed for {}: {e:#}", s.name),
            }
        }
    }
    let torch_best = |name: &str, ctx: usize| -> Option<(f64, Option<f64>)> {
        torch
            .iter()
            .find(|v| v["name"] == name && v["ctx"] == ctx)
            .map(|v| {
                (
                    v["eager_ms"].as_f64().unwrap_or(f64::NAN),
                    v["graph_ms"].as_f64(),
                )
            })
    };

    md += "### Draft step (block 16: embedding + 5 layers + lm_head on 15 rows + argmax)\n\n";
    md += "| shape | ctx | weights | ours eager ms | ours graph ms | HBM floor ms (GB read) | graph / floor | PyTorch bf16 eager ms | PyTorch bf16 graph ms | best PyTorch / ours |\n";
    md += "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n";
    for r in &rows {
        let ours = r.t.graph.unwrap_or(r.t.eager);
        // Without the peer (`--no-torch`, or it failed): "-" in its columns.
        let peer = torch_best(r.shape, r.ctx);
        let te = peer.map_or("-".to_string(), |(e, _)| format!("{e:.3}"));
        let tg = peer.and_then(|(_, g)| g);
        let best = peer.map_or("-".to_string(), |(e, g)| {
            format!("{:.2}x", g.map_or(e, |x| x.min(e)) / ours)
        });
        md += &format!(
            "| {} | {} | {} | {:.3} | {} | {:.3} ({:.2}) | {:.2}x | {} | {} | {} |\n",
            r.shape,
            r.ctx,
            variant_name(r.fmt, r.fast, r.kv),
            r.t.eager,
            r.t.graph
                .map(|x| format!("{x:.3}"))
                .unwrap_or_else(|| format!(
                    "failed: {}",
                    r.t.graph_err.clone().unwrap_or_default()
                )),
            r.floor_ms,
            r.bytes as f64 / 1e9,
            ours / r.floor_ms,
            te,
            tg.map(|x| format!("{x:.3}")).unwrap_or("-".into()),
            best
        );
    }
    if rows.iter().any(|r| r.markov.is_some()) {
        md += "\n### DSpark variant: the same step + Markov chain (rank 256, 15 sequential steps on the device)\n\n| shape | ctx | weights | eager ms | graph ms |\n|---|---:|---|---:|---:|\n";
        for r in rows.iter().filter(|r| r.markov.is_some()) {
            if let Some(t) = &r.markov {
                md += &format!(
                    "| {} | {} | {} | {:.3} | {} |\n",
                    r.shape,
                    r.ctx,
                    variant_name(r.fmt, r.fast, r.kv),
                    t.eager,
                    t.graph.map(|x| format!("{x:.3}")).unwrap_or("-".into())
                );
            }
        }
    }
    if !target_rows.is_empty() {
        md += "\n### Dense target at the Qwen3-8B shape (36 layers): verify 16 vs decode 1 (CUDA graph)\n\n";
        md += "| target weights | ctx | decode1 ms | verify16 ms | verify16 / decode1 | decode1 HBM floor ms | decode1 / floor |\n|---|---:|---:|---:|---:|---:|---:|\n";
        for (label, ctx, v, d, floor) in &target_rows {
            let (vm, dm) = (v.graph.unwrap_or(v.eager), d.graph.unwrap_or(d.eager));
            md += &format!(
                "| {label} | {ctx} | {dm:.3} | {vm:.3} | {:.2}x | {floor:.3} | {:.2}x |\n",
                vm / dm,
                dm / floor
            );
        }
        md += "\n### Projected end-to-end speedup at tau 6.5 (PROJECTION, not a measurement)\n\n";
        md += "tau = 6.5 committed tokens per round (published Qwen3-8B-DFlash-b16 acceptance on GSM8K); one round = one draft step + one verify16; plain greedy = one decode1 per token of the same target: speedup = 6.5 x decode1 / (draft + verify16), from the times above (graph replays).\n\n| target weights | ctx | drafter weights | draft ms | verify16 ms | decode1 ms | projected speedup |\n|---|---:|---|---:|---:|---:|---:|\n";
        for (label, ctx, v, d, _) in &target_rows {
            for r in rows
                .iter()
                .filter(|r| r.ctx == *ctx && r.shape == "Qwen3-8B-DFlash-b16")
            {
                let draft = r.t.graph.unwrap_or(r.t.eager);
                let (vm, dm) = (v.graph.unwrap_or(v.eager), d.graph.unwrap_or(d.eager));
                md += &format!(
                    "| {label} | {ctx} | {} | {draft:.3} | {vm:.3} | {dm:.3} | {:.2}x |\n",
                    variant_name(r.fmt, r.fast, r.kv),
                    6.5 * dm / (draft + vm)
                );
            }
        }
    }
    md += &ops_md;
    if let Some(v) = torch.first() {
        md += &format!(
            "\nPyTorch {} on {}.\n",
            v["torch"].as_str().unwrap_or("?"),
            v["device"].as_str().unwrap_or("?")
        );
    }
    println!("\n{md}");
    if let Some(p) = a.md {
        std::fs::write(&p, &md).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// `A/O`: the preferred shared-memory carveouts in percent of the Q8_0A8 matmuls and of every
/// other kernel (-1: the driver's choice).
fn parse_carveout(s: &str) -> Result<(i32, i32)> {
    let (a8, o) = s
        .split_once('/')
        .ok_or_else(|| anyhow!("expected A/O (percent, -1: the driver's choice), found {s}"))?;
    Ok((a8.parse()?, o.parse()?))
}

/// The q8_0a8 draft step under several Q8_0A8 kernel choices, side by side: two rounds over
/// the choices (so drift between the first and the last shows), graph ms per round.
fn a8_sweep(g: &Cuda, a: &BenchArgs, list: &str, shapes: &[Shape], ctxs: &[usize]) -> Result<()> {
    // Each entry: a Q8_0A8 kernel name, optionally `+noef` (weights streamed without the
    // evict-first hint), `+nopdl` (no programmatic dependent launch of quantizer + matmul), `+asN`
    // (attention split of N keys), `+att=NAME` (attention kernel), `+nofa` / `+faall` / `+fabN` / `+nowg`
    // (the FA f16-cache kernel off / on every call / long splits for N blocks per SM).
    struct Config {
        name: String,
        kernel: A8Kernel,
        evict_first: bool,
        pdl: bool,
        attn_split: Option<usize>,
        attn: AttnKernel,
        prefetch: [usize; 5],
        skip: String,
        fast_attn: bool,
        kv: KvStorage,
        q8norm: bool,
        q8epi: bool,
        q8pair: bool,
        attn_f16: bool,
        attn_fa: AttnFa,
        markov_persistent: bool,
        pair_kernel: Option<(u8, u8)>,
        pair_queue: bool,
        proj_kernels: [Option<A8Kernel>; 4],
        prewait: Option<[bool; 4]>,
        carveout: (i32, i32),
    }
    let configs: Vec<Config> = list
        .split(',')
        .map(|c| {
            let mut it = c.trim().split('+');
            let mut cfg = Config {
                name: c.trim().to_string(),
                kernel: parse_a8_kernel(it.next().unwrap_or("auto"))?,
                evict_first: true,
                pdl: true,
                attn_split: a.attn_split,
                attn: parse_attn_kernel(&a.attn_kernel)?,
                prefetch: parse_prefetch(&a.l2_prefetch)?,
                skip: String::new(),
                fast_attn: false,
                kv: KvStorage::F32,
                q8norm: !a.no_a8_producers,
                q8epi: false,
                q8pair: true,
                attn_f16: true,
                attn_fa: AttnFa::default(),
                markov_persistent: true,
                pair_kernel: None,
                pair_queue: true,
                proj_kernels: [None; 4],
                prewait: None,
                carveout: (SMEM_CARVEOUT_A8, SMEM_CARVEOUT_OTHER),
            };
            for opt in it {
                if opt == "noef" {
                    cfg.evict_first = false;
                } else if opt == "nopdl" {
                    cfg.pdl = false;
                } else if let Some(n) = opt.strip_prefix("as") {
                    cfg.attn_split = Some(n.parse()?);
                } else if let Some(n) = opt.strip_prefix("att=") {
                    cfg.attn = parse_attn_kernel(n)?;
                } else if let Some(n) = opt.strip_prefix("pf=") {
                    cfg.prefetch = parse_prefetch(n)?;
                } else if opt == "fa" {
                    cfg.fast_attn = true;
                } else if opt == "kv16" {
                    cfg.fast_attn = true;
                    cfg.kv = KvStorage::F16;
                } else if opt == "q8n" {
                    cfg.q8norm = true;
                } else if opt == "noq8n" {
                    cfg.q8norm = false;
                } else if opt == "q8e" {
                    cfg.q8epi = true;
                } else if opt == "nopair" {
                    cfg.q8pair = false;
                } else if opt == "x1" {
                    cfg.attn_f16 = false;
                } else if opt == "nofa" {
                    cfg.attn_fa.long = false;
                } else if opt == "faall" {
                    cfg.attn_fa.all = true;
                } else if opt == "nowg" {
                    cfg.attn_fa.wgmma = false;
                } else if let Some(n) = opt.strip_prefix("fab") {
                    // The FA kernel's long-span split sized for N blocks per SM.
                    cfg.attn_fa.blocks_per_sm = n.parse()?;
                } else if opt == "noq" {
                    // The paired gate / up launch without its queue of pieces.
                    cfg.pair_queue = false;
                } else if opt == "mksteps" {
                    cfg.markov_persistent = false;
                } else if let Some(n) = opt.strip_prefix("gp=k") {
                    // The paired gate / up kernel: gp=kKSsS (k-slices, stages), e.g. gp=k1s3.
                    let (ks, st) = n
                        .split_once('s')
                        .ok_or_else(|| anyhow!("--a8-sweep: gp=kKSsS, found {opt}"))?;
                    cfg.pair_kernel = Some((ks.parse()?, st.parse()?));
                } else if let Some((which, k)) = opt
                    .split_once('=')
                    .filter(|(w, _)| ["qkv", "o", "gu", "down"].contains(w))
                {
                    let i = ["qkv", "o", "gu", "down"]
                        .iter()
                        .position(|w| *w == which)
                        .unwrap_or(0);
                    cfg.proj_kernels[i] = Some(parse_a8_kernel(k)?);
                } else if let Some(n) = opt.strip_prefix("pw=") {
                    // All but one weight stage before the wait (1) or one (0), for q/k/v, o,
                    // gate/up, down.
                    let d: Vec<bool> = n.chars().map(|c| c == '1').collect();
                    if n.len() != 4 || !n.chars().all(|c| c == '0' || c == '1') {
                        bail!(
                            "--a8-sweep: pw=BBBB (0 or 1 for q/k/v, o, gate/up, down), found {opt}"
                        );
                    }
                    cfg.prewait = Some([d[0], d[1], d[2], d[3]]);
                } else if let Some(n) = opt.strip_prefix("co=") {
                    cfg.carveout = parse_carveout(n).context("--a8-sweep co=")?;
                } else if let Some(n) = opt.strip_prefix("skip=") {
                    cfg.skip = n.to_string();
                } else {
                    bail!("--a8-sweep: unknown option {opt} in {c}");
                }
            }
            Ok(cfg)
        })
        .collect::<Result<_>>()?;
    // The projection table: the plain kernel names only.
    let kernels: Vec<(String, A8Kernel)> = configs
        .iter()
        .filter(|c| !c.name.contains('+'))
        .map(|c| (c.name.clone(), c.kernel))
        .collect();
    set_split(g, a.attn_split)?;
    g.set_attn_kernel(parse_attn_kernel(&a.attn_kernel)?)?;
    // The drafters' projections (16 rows; q/k/v and gate/up as the step's `matmul_many`), each
    // as a graph of enough distinct copies that the weights do not stay in L2 (>= 150 MB).
    let bw = copy_bandwidth(g)?;
    println!("| projection (16 rows) | copies | a8 kernel | us per call round 1 | round 2 | GB/s | % of copy bw |\n|---|---:|---|---:|---:|---:|---:|");
    for (name, ns, k) in if kernels.is_empty() {
        vec![]
    } else {
        vec![
            ("8B q/k/v", vec![4096usize, 1024, 1024], 4096usize),
            ("8B o", vec![4096], 4096),
            ("8B gate/up", vec![12288, 12288], 4096),
            ("8B down", vec![4096], 12288),
            ("8B lm_head", vec![151936], 4096),
            ("27B q/k/v", vec![4096, 1024, 1024], 5120),
            ("27B o", vec![5120], 4096),
            ("27B gate/up", vec![17408, 17408], 5120),
            ("27B down", vec![5120], 17408),
            ("27B lm_head", vec![248320], 5120),
        ]
    } {
        let one: usize = ns.iter().map(|&n| n * (k / 32) * 34).sum();
        let copies = (150_000_000usize).div_ceil(one).max(2);
        let mut p = ProjCopies::new(g, &ns, k, a8_format(a), 16, copies, 9)?;
        let mut t = vec![Vec::new(); kernels.len()];
        for _round in 0..2 {
            for (i, (_, kern)) in kernels.iter().enumerate() {
                g.set_a8_kernel(*kern);
                t[i].push(p.time(g, a.iters)? * 1e3);
            }
        }
        for ((kname, _), v) in kernels.iter().zip(&t) {
            let best = v[0].min(v[1]);
            let gbs = one as f64 / best / 1e3;
            println!(
                "| {name} | {copies} | {kname} | {:.1} | {:.1} | {gbs:.0} | {:.0}% |",
                v[0],
                v[1],
                100.0 * gbs * 1e9 / bw
            );
        }
    }
    println!(
        "\n| shape | ctx | a8 kernel | graph ms round 1 | round 2 |\n|---|---:|---|---:|---:|"
    );
    for s in shapes {
        let cap = ctxs.iter().max().copied().unwrap_or(512) + s.block;
        let mut m = Model::new(g, s, a8_format(a), cap, false, 42)?;
        m.fused = !a.unfused;
        m.prefetch = parse_prefetch(&a.l2_prefetch)?;
        if a.markov {
            // The DSpark step: the same Markov weights as the main table's q8_0a8 rows.
            let f = WeightFormat::Q8_0A8;
            m.markov = Some((
                g.random_weight("w1", s.vocab, 256, f, 77, 1.0)?,
                g.random_weight("w2", s.vocab, 256, f, 78, 1.0 / 16.0)?,
            ));
        }
        let mut b = m.bufs(g, s.block)?;
        for &ctx in ctxs {
            let mut t = vec![Vec::new(); configs.len()];
            for _round in 0..2 {
                for (i, c) in configs.iter().enumerate() {
                    g.set_a8_kernel(c.kernel);
                    g.set_a8_evict_first(c.evict_first);
                    g.set_a8_pdl(c.pdl);
                    match c.pair_kernel {
                        Some((ks, st)) => g.set_a8_pair_kernel(ks, st)?,
                        None => g.set_a8_pair_kernel_auto(),
                    }
                    g.set_a8_pair_queue(c.pair_queue);
                    set_split(g, c.attn_split)?;
                    g.set_attn_kernel(c.attn)?;
                    g.set_attn_fast_f16(c.attn_f16);
                    g.set_attn_fa(c.attn_fa)?;
                    g.set_markov_persistent(c.markov_persistent);
                    g.set_smem_carveout(c.carveout.0, c.carveout.1)?;
                    m.prefetch = c.prefetch;
                    m.skip = c.skip.clone();
                    m.fast_attn = c.fast_attn;
                    m.set_kv(g, c.kv)?;
                    m.q8norm = c.q8norm;
                    m.q8epi = c.q8epi;
                    m.q8pair = c.q8pair;
                    m.proj_kernels = c.proj_kernels;
                    m.prewait = c.prewait;
                    m.base_kernel = c.kernel;
                    let st = time_forward(g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)?;
                    t[i].push(st.graph.unwrap_or(f64::NAN));
                }
            }
            for (c, v) in configs.iter().zip(&t) {
                println!(
                    "| {} | {ctx} | {} | {:.4} | {:.4} |",
                    s.name, c.name, v[0], v[1]
                );
            }
        }
    }
    g.set_a8_kernel(A8Kernel::Auto);
    g.set_a8_evict_first(true);
    g.set_a8_prewait(None);
    g.set_a8_pdl(true);
    g.set_a8_pair_kernel_auto();
    g.set_a8_pair_queue(true);
    g.set_attn_split_auto();
    g.set_attn_kernel(AttnKernel::Auto)?;
    g.set_attn_fast_f16(true);
    g.set_attn_fa(AttnFa::default())?;
    g.set_markov_persistent(true);
    g.set_smem_carveout(SMEM_CARVEOUT_A8, SMEM_CARVEOUT_OTHER)?;
    Ok(())
}

/// The q8_0a8 + fast-attention model of `--timeline` and `--trace` (the KV cache as `--kv16`
/// says, room for the largest context) and its buffers.
fn fast_a8_model(g: &Cuda, a: &BenchArgs, s: &Shape, ctxs: &[usize]) -> Result<(Model, Bufs)> {
    let cap = ctxs.iter().max().copied().unwrap_or(512) + s.block;
    let mut m = Model::new(g, s, a8_format(a), cap, false, 42)?;
    m.prefetch = parse_prefetch(&a.l2_prefetch)?;
    m.fast_attn = true;
    m.set_kv(g, kv_arg(a))?;
    m.q8norm = !a.no_a8_producers;
    let b = m.bufs(g, s.block)?;
    Ok((m, b))
}

/// The A8 format of `--timeline`, `--trace` and `--a8-sweep`: Q4_0A8 where --formats starts
/// with `q4_0a8` (the same step over the Q4_0A8 twins), else Q8_0A8.
fn a8_format(a: &BenchArgs) -> WeightFormat {
    if a.formats.trim_start().starts_with("q4_0a8") {
        WeightFormat::Q4_0A8
    } else {
        WeightFormat::Q8_0A8
    }
}

/// One draft step (`rows` tokens at ctx) captured as a CUDA graph on the op stream.
fn capture_step(
    g: &Cuda,
    m: &mut Model,
    b: &mut Bufs,
    rows: usize,
    ctx: usize,
) -> Result<cudarc::driver::CudaGraph> {
    let st = g.stream().clone();
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let r = m.forward(g, b, rows, ctx, false, 1);
    let gr = st.end_capture(CUgraphInstantiate_flags(0));
    r?;
    gr?.ok_or_else(|| anyhow!("empty capture"))
}

/// The q8_0a8 + fast-attention step's per-block trace (see `BenchArgs::trace`): for each
/// shape and context, the step's graph replayed a few times, the records reset, one replay
/// recorded.
fn block_trace(
    g: &Cuda,
    a: &BenchArgs,
    shapes: &[Shape],
    ctxs: &[usize],
    path: &PathBuf,
) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "shape,ctx,module,line,kind,sm,t0_ns,t1_ns,block,blocks")?;
    for s in shapes {
        let (mut m, mut b) = fast_a8_model(g, a, s, ctxs)?;
        for &ctx in ctxs {
            let t = time_forward(g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)?;
            let gr = capture_step(g, &mut m, &mut b, s.block, ctx)?;
            let (n, dropped) = write_trace(g, &gr, &mut f, s.name, ctx)?;
            println!(
                "{} ctx {ctx}: step {:.4} ms (graph, traced kernels), {n} records, {dropped} dropped",
                s.name,
                t.graph.unwrap_or(f64::NAN)
            );
        }
    }
    f.flush()?;
    Ok(())
}

/// One graph replay's block records written as CSV rows under `name` (see
/// [`block_trace`]); the replays before it not recorded.
fn write_trace(
    g: &Cuda,
    gr: &cudarc::driver::CudaGraph,
    f: &mut impl std::io::Write,
    name: &str,
    ctx: usize,
) -> Result<(usize, u64)> {
    for _ in 0..5 {
        gr.launch()?;
    }
    g.block_trace_reset()?;
    gr.launch()?;
    let (recs, dropped) = g.block_trace()?;
    let n = recs.len();
    for r in recs {
        writeln!(
            f,
            "{name},{ctx},{},{},{},{},{},{},{},{}",
            r.module,
            r.line,
            match r.kind {
                dflash_cuda_kernels::registry::BlockTraceKind::Wait => "wait",
                dflash_cuda_kernels::registry::BlockTraceKind::End => "end",
            },
            r.sm,
            r.t0_ns,
            r.t1_ns,
            r.block,
            r.blocks
        )?;
    }
    Ok((n, dropped))
}

/// The dense target's per-block trace (see `BenchArgs::trace_target`): decode1 and verify16
/// graphs of a `--trace-layers`-layer Qwen3-8B-shaped target at each format and context.
fn target_trace(g: &Cuda, a: &BenchArgs, ctxs: &[usize], path: &PathBuf) -> Result<()> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(f, "shape,ctx,module,line,kind,sm,t0_ns,t1_ns,block,blocks")?;
    let s = Shape {
        layers: a.trace_layers,
        windows: vec![None; a.trace_layers],
        ..dense_8b_target()?
    };
    let cap = ctxs.iter().max().copied().unwrap_or(512) + 16;
    for entry in a.target_formats.split(',') {
        let (mut m, _, label) = target_model(g, &s, entry, cap)?;
        m.fused = !a.unfused;
        m.attn_tail = !a.separate_attn_tail;
        m.q8norm = !a.no_a8_producers;
        for rows in [1, 16] {
            let mut b = m.bufs(g, rows)?;
            for &ctx in ctxs {
                let t = time_forward(g, &mut m, &mut b, rows, ctx, true, 0, a.iters)?;
                let st = g.stream().clone();
                st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
                let r = m.forward(g, &mut b, rows, ctx, true, 0);
                let gr = st.end_capture(CUgraphInstantiate_flags(0));
                r?;
                let gr = gr?.ok_or_else(|| anyhow!("empty capture"))?;
                let name = format!("{label} {}", if rows == 1 { "decode1" } else { "verify16" });
                let (n, dropped) = write_trace(g, &gr, &mut f, &name, ctx)?;
                println!(
                    "{name} ctx {ctx}, {} layers: {:.4} ms (graph, traced kernels), {n} records, {dropped} dropped",
                    s.layers,
                    t.graph.unwrap_or(f64::NAN)
                );
            }
        }
    }
    f.flush()?;
    Ok(())
}

/// The q8_0a8 + fast-attention step's timeline (see `BenchArgs::timeline`): for each shape
/// and context, the step's graph time without and with the marks, then per op the median us
/// since the previous mark and the same summed per kind of op (the name without its layer).
fn timeline(g: &Cuda, a: &BenchArgs, shapes: &[Shape], ctxs: &[usize]) -> Result<()> {
    let bw = copy_bandwidth(g)?;
    for s in shapes {
        let (mut m, mut b) = fast_a8_model(g, a, s, ctxs)?;
        for &ctx in ctxs {
            m.timeline = None;
            let plain = time_forward(g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)
                .context("the step without marks")?;
            m.timeline = Some(Timeline {
                events: Vec::new(),
                names: Vec::new(),
            });
            let marked = time_forward(g, &mut m, &mut b, s.block, ctx, false, 1, a.iters)
                .context("the step with marks")?;
            if let Some(e) = &marked.graph_err {
                bail!("the marked step's graph: {e}");
            }
            // Replays of one captured step, the marks read back after each.
            let st = g.stream().clone();
            let gr = capture_step(g, &mut m, &mut b, s.block, ctx)?;
            let tl = m.timeline.take().ok_or_else(|| anyhow!("no timeline"))?;
            let n = tl.names.len();
            let mut deltas = vec![Vec::new(); n];
            for it in 0..a.iters + 3 {
                gr.launch()?;
                st.synchronize()?;
                if it >= 3 {
                    // deltas[0]: first to last mark; deltas[i]: mark i - 1 to mark i.
                    deltas[0].push(tl.events[0].elapsed_ms(&tl.events[n - 1])? as f64 * 1e3);
                    for (i, (pair, d)) in tl.events.windows(2).zip(&mut deltas[1..]).enumerate() {
                        let ms = pair[0]
                            .elapsed_ms(&pair[1])
                            .with_context(|| format!("elapsed time to mark {}", i + 1))?;
                        d.push(ms as f64 * 1e3);
                    }
                }
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(|x, y| x.total_cmp(y));
                v[v.len() / 2]
            };
            let meds: Vec<f64> = deltas.iter_mut().map(med).collect();
            println!(
                "\n### {} ctx {ctx}: step {:.4} ms (graph), {:.4} ms with the marks; first to last mark {:.1} us (median); copy bandwidth {:.0} GB/s\n",
                s.name,
                plain.graph.unwrap_or(f64::NAN),
                marked.graph.unwrap_or(f64::NAN),
                meds[0],
                bw / 1e9
            );
            println!("| op (ends at the mark) | us since the previous mark |\n|---|---:|");
            for (name, us) in tl.names.iter().zip(&meds).skip(1) {
                println!("| {name} | {us:.1} |");
            }
            // Per kind: the name without its "L<i> " prefix.
            let mut kinds: Vec<(String, f64, usize)> = Vec::new();
            for (name, &us) in tl.names.iter().zip(&meds).skip(1) {
                let k = match name.split_once(' ') {
                    Some((l, rest)) if l.starts_with('L') => rest.to_string(),
                    _ => name.clone(),
                };
                match kinds.iter_mut().find(|(kk, _, _)| *kk == k) {
                    Some(e) => {
                        e.1 += us;
                        e.2 += 1;
                    }
                    None => kinds.push((k, us, 1)),
                }
            }
            println!("\n| kind | count | us (sum of medians) |\n|---|---:|---:|");
            for (k, us, c) in &kinds {
                println!("| {k} | {c} | {us:.1} |");
            }
        }
    }
    Ok(())
}

/// The attention split: `keys` when given, else the backend's automatic choice.
fn set_split(g: &Cuda, keys: Option<usize>) -> Result<()> {
    match keys {
        Some(k) => g.set_attn_split(k)?,
        None => g.set_attn_split_auto(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attn_kernel_names() {
        let tc = |key_warps, ffma_pv, row_warps, stages| AttnKernel::Tc {
            key_warps,
            row_warps,
            ffma_pv,
            stages,
        };
        assert_eq!(parse_attn_kernel("auto").unwrap(), AttnKernel::Auto);
        assert_eq!(parse_attn_kernel("simt").unwrap(), AttnKernel::Simt);
        assert_eq!(parse_attn_kernel("tc4").unwrap(), tc(4, false, 0, 0));
        assert_eq!(parse_attn_kernel("tc2f").unwrap(), tc(2, true, 0, 0));
        assert_eq!(parse_attn_kernel("tc4r4s2").unwrap(), tc(4, false, 4, 2));
        assert_eq!(parse_attn_kernel("tc2fs3").unwrap(), tc(2, true, 0, 3));
        for bad in ["tc", "tcx", "tc4q", "tc4r", "tc4rs2", "gpu"] {
            assert!(parse_attn_kernel(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_peers_last_json_list_is_its_result() {
        let text = "warming up\n[{\"p\": 1}]\nnote\n[{\"p\": 2, \"ms\": 3.5}]\n";
        let v = json_list(text, "peer").unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0]["p"].as_u64(), Some(2));
        assert_eq!(v[0]["ms"].as_f64(), Some(3.5));
        assert!(json_list("no list here\n", "peer").is_err());
    }
}

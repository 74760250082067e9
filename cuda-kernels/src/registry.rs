//! The typed kernel registry: CUDA C sources embedded with `include_str!`, compiled by NVRTC
//! for the device's compute capability at first use, loaded once and cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::error::CudaError;

/// Helpers shared by every module (prepended to each source; kernels have no `#include`).
pub const PRELUDE: &str = include_str!("../kernels/prelude.cuh");

/// One compilation unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Elementwise,
    Reduce,
    Matmul,
    /// matmul.cu's Q8_0A8 matmul kernels compiled with `A8_WQ4`: for Q4_0A8 weights
    /// (the other kernels of matmul.cu are left out of it).
    MatmulQ4,
    Attention,
}

impl Module {
    pub const ALL: [Module; 5] = [
        Module::Elementwise,
        Module::Reduce,
        Module::Matmul,
        Module::MatmulQ4,
        Module::Attention,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Module::Elementwise => "elementwise",
            Module::Reduce => "reduce",
            Module::Matmul => "matmul",
            Module::MatmulQ4 => "matmul_q4",
            Module::Attention => "attention",
        }
    }

    /// The module's own source (without the prelude).
    pub fn source(self) -> &'static str {
        match self {
            Module::Elementwise => include_str!("../kernels/elementwise.cu"),
            Module::Reduce => include_str!("../kernels/reduce.cu"),
            Module::Matmul | Module::MatmulQ4 => include_str!("../kernels/matmul.cu"),
            Module::Attention => include_str!("../kernels/attention.cu"),
        }
    }

    /// Prelude + source, as handed to NVRTC (with `#define A8_WQ4` for [`Module::MatmulQ4`]).
    pub fn full_source(self) -> String {
        let define = if self == Module::MatmulQ4 {
            "#define A8_WQ4 1\n"
        } else {
            ""
        };
        format!(
            "{PRELUDE}\n{define}#line 1 \"{}.cu\"\n{}",
            self.name(),
            self.source()
        )
    }
}

macro_rules! kernels {
    ($($variant:ident => ($module:ident, $name:literal),)*) => {
        /// Every kernel entry point, with the module that defines it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel { $($variant,)* }

        impl Kernel {
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];
            pub fn module(self) -> Module { match self { $(Kernel::$variant => Module::$module,)* } }
            pub fn name(self) -> &'static str { match self { $(Kernel::$variant => $name,)* } }
        }
    };
}

kernels! {
    Fill => (Elementwise, "fill_f32"),
    RmsNorm => (Elementwise, "rms_norm"),
    RmsNormSplit => (Elementwise, "rms_norm_split"),
    AddRmsNormSplit => (Elementwise, "add_rms_norm_split"),
    SiluMulSplit => (Elementwise, "silu_mul_split"),
    RmsNormGated => (Elementwise, "rms_norm_gated"),
    RmsNormGatedSplit => (Elementwise, "rms_norm_gated_split"),
    AddRmsNorm => (Elementwise, "add_rms_norm"),
    RmsNormQ8 => (Elementwise, "rms_norm_q8"),
    QkNormRopeKv => (Elementwise, "qk_norm_rope_kv"),
    QkNormRopeKvRows => (Elementwise, "qk_norm_rope_kv_rows"),
    Rope => (Elementwise, "rope"),
    SiluMul => (Elementwise, "silu_mul"),
    AddAssign => (Elementwise, "add_assign"),
    Scale => (Elementwise, "scale"),
    MulSigmoid => (Elementwise, "mul_sigmoid"),
    MulSigmoidSplit => (Elementwise, "mul_sigmoid_split"),
    Copy2d => (Elementwise, "copy2d"),
    F16Pack => (Elementwise, "f16_pack"),
    F16Unpack => (Elementwise, "f16_unpack"),
    GatherRows => (Elementwise, "gather_rows"),
    GdnGates => (Elementwise, "gdn_gates"),
    CausalConv1d => (Elementwise, "causal_conv1d"),
    GatedDeltaRule => (Elementwise, "gated_delta_rule"),
    GatedDeltaRuleR16 => (Elementwise, "gated_delta_rule_r16"),
    GatedDeltaRuleR32 => (Elementwise, "gated_delta_rule_r32"),
    GdnChunkPrep => (Elementwise, "gdn_chunk_prep"),
    GdnChunkState => (Elementwise, "gdn_chunk_state"),
    GdnChunkOut => (Elementwise, "gdn_chunk_out"),
    L2Prefetch => (Elementwise, "l2_prefetch"),
    FillRandomU32 => (Elementwise, "fill_random_u32"),
    FillRandomHalf => (Elementwise, "fill_random_half"),
    FillRandomF32 => (Elementwise, "fill_random_f32"),
    ArgmaxPartial => (Reduce, "argmax_partial"),
    ArgmaxFinal => (Reduce, "argmax_final"),
    MarkovStep => (Reduce, "markov_step"),
    MarkovStepA8 => (Reduce, "markov_step_a8"),
    MarkovStepV => (Reduce, "markov_step_v"),
    MarkovStepVQ => (Reduce, "markov_step_vq"),
    MarkovStepMmaBf16P => (Matmul, "markov_step_mma_bf16p"),
    MarkovStepMmaQ8_0 => (Matmul, "markov_step_mma_q8_0"),
    MarkovStepMmaQ4_0 => (Matmul, "markov_step_mma_q4_0"),
    MarkovChainA8P => (Reduce, "markov_chain_a8p"),
    SkinnyBf16N1 => (Matmul, "skinny_bf16_n1"),
    SkinnyBf16N2 => (Matmul, "skinny_bf16_n2"),
    SkinnyBf16PN1 => (Matmul, "skinny_bf16p_n1"),
    SkinnyBf16PN2 => (Matmul, "skinny_bf16p_n2"),
    SkinnyBf16PN1R4 => (Matmul, "skinny_bf16p_n1_r4"),
    SkinnyBf16PN2R4 => (Matmul, "skinny_bf16p_n2_r4"),
    SkinnyQ8N1 => (Matmul, "skinny_q8_0_n1"),
    SkinnyQ8N2 => (Matmul, "skinny_q8_0_n2"),
    SkinnyQ4N1 => (Matmul, "skinny_q4_0_n1"),
    SkinnyQ4N2 => (Matmul, "skinny_q4_0_n2"),
    SkinnyBf16N1R4 => (Matmul, "skinny_bf16_n1_r4"),
    SkinnyBf16N2R4 => (Matmul, "skinny_bf16_n2_r4"),
    SkinnyQ8N1R4 => (Matmul, "skinny_q8_0_n1_r4"),
    SkinnyQ8N2R4 => (Matmul, "skinny_q8_0_n2_r4"),
    SkinnyQ4N1R4 => (Matmul, "skinny_q4_0_n1_r4"),
    SkinnyQ4N2R4 => (Matmul, "skinny_q4_0_n2_r4"),
    SkinnySimt => (Matmul, "skinny_simt"),
    Skinny4Bf16N1 => (Matmul, "skinny4_bf16_n1"),
    Skinny4Bf16N2 => (Matmul, "skinny4_bf16_n2"),
    Skinny4Bf16PN1 => (Matmul, "skinny4_bf16p_n1"),
    Skinny4Bf16PN2 => (Matmul, "skinny4_bf16p_n2"),
    Skinny4Q8N1 => (Matmul, "skinny4_q8_0_n1"),
    Skinny4Q8N2 => (Matmul, "skinny4_q8_0_n2"),
    Skinny4Q4N1 => (Matmul, "skinny4_q4_0_n1"),
    Skinny4Q4N2 => (Matmul, "skinny4_q4_0_n2"),
    SkinnyGluBf16N1 => (Matmul, "skinny_glu_bf16_n1"),
    SkinnyGluBf16N1R4 => (Matmul, "skinny_glu_bf16_n1_r4"),
    SkinnyGluBf16N2 => (Matmul, "skinny_glu_bf16_n2"),
    SkinnyGluBf16N2R4 => (Matmul, "skinny_glu_bf16_n2_r4"),
    SkinnyGluBf16PN1 => (Matmul, "skinny_glu_bf16p_n1"),
    SkinnyGluBf16PN1R4 => (Matmul, "skinny_glu_bf16p_n1_r4"),
    SkinnyGluBf16PN2 => (Matmul, "skinny_glu_bf16p_n2"),
    SkinnyGluBf16PN2R4 => (Matmul, "skinny_glu_bf16p_n2_r4"),
    SkinnyGluQ8N1 => (Matmul, "skinny_glu_q8_0_n1"),
    SkinnyGluQ8N1R4 => (Matmul, "skinny_glu_q8_0_n1_r4"),
    SkinnyGluQ8N2 => (Matmul, "skinny_glu_q8_0_n2"),
    SkinnyGluQ8N2R4 => (Matmul, "skinny_glu_q8_0_n2_r4"),
    SkinnyGluQ4N1 => (Matmul, "skinny_glu_q4_0_n1"),
    SkinnyGluQ4N1R4 => (Matmul, "skinny_glu_q4_0_n1_r4"),
    SkinnyGluQ4N2 => (Matmul, "skinny_glu_q4_0_n2"),
    SkinnyGluQ4N2R4 => (Matmul, "skinny_glu_q4_0_n2_r4"),
    SplitBf16 => (Matmul, "split_bf16"),
    UnpackBf16P => (Matmul, "unpack_bf16p"),
    UnpackQuantHiLo => (Matmul, "unpack_quant_hilo"),
    A8SplitX => (Matmul, "a8_split_x"),
    A8QuantX => (Matmul, "a8_quant_x"),
    A8N1W1 => (Matmul, "a8_n1_w1"),
    A8N1W2 => (Matmul, "a8_n1_w2"),
    A8N1W4 => (Matmul, "a8_n1_w4"),
    A8N2W1 => (Matmul, "a8_n2_w1"),
    A8N2W2 => (Matmul, "a8_n2_w2"),
    A8N2W4 => (Matmul, "a8_n2_w4"),
    A8Sum => (Matmul, "a8_sum"),
    A8KN1W1K4S3 => (Matmul, "a8k_n1_w1_k4_s3"),
    A8KN1W1K2S3 => (Matmul, "a8k_n1_w1_k2_s3"),
    A8KN1W2K2S4 => (Matmul, "a8k_n1_w2_k2_s4"),
    A8KN1W2K4S3 => (Matmul, "a8k_n1_w2_k4_s3"),
    A8KN1W2K4S2 => (Matmul, "a8k_n1_w2_k4_s2"),
    A8KN1W4K1S3 => (Matmul, "a8k_n1_w4_k1_s3"),
    A8KN1W4K2S3 => (Matmul, "a8k_n1_w4_k2_s3"),
    A8KN1W4K2S2 => (Matmul, "a8k_n1_w4_k2_s2"),
    A8KN1W4K4S2 => (Matmul, "a8k_n1_w4_k4_s2"),
    A8KN2W1K4S3 => (Matmul, "a8k_n2_w1_k4_s3"),
    A8KN2W1K2S3 => (Matmul, "a8k_n2_w1_k2_s3"),
    A8KN2W2K2S4 => (Matmul, "a8k_n2_w2_k2_s4"),
    A8KN2W2K4S3 => (Matmul, "a8k_n2_w2_k4_s3"),
    A8KN2W2K4S2 => (Matmul, "a8k_n2_w2_k4_s2"),
    A8KN2W4K1S3 => (Matmul, "a8k_n2_w4_k1_s3"),
    A8KN2W4K2S3 => (Matmul, "a8k_n2_w4_k2_s3"),
    A8KN2W4K2S2 => (Matmul, "a8k_n2_w4_k2_s2"),
    A8KN2W4K4S2 => (Matmul, "a8k_n2_w4_k4_s2"),
    A8KPN1W4K2S2 => (Matmul, "a8kp_n1_w4_k2_s2"),
    A8KPN2W4K2S2 => (Matmul, "a8kp_n2_w4_k2_s2"),
    A8KPN1W4K1S3 => (Matmul, "a8kp_n1_w4_k1_s3"),
    A8KPN2W4K1S3 => (Matmul, "a8kp_n2_w4_k1_s3"),
    A8KPN1W4K1S2 => (Matmul, "a8kp_n1_w4_k1_s2"),
    A8KPN2W4K1S2 => (Matmul, "a8kp_n2_w4_k1_s2"),
    A8KPQN1W4K1S2 => (Matmul, "a8kpq_n1_w4_k1_s2"),
    A8KPQN2W4K1S2 => (Matmul, "a8kpq_n2_w4_k1_s2"),
    AttnSplitD32 => (Attention, "attn_split_d32"),
    AttnSplitD64 => (Attention, "attn_split_d64"),
    AttnSplitD128 => (Attention, "attn_split_d128"),
    AttnSplitD256 => (Attention, "attn_split_d256"),
    AttnTcD32Kw2 => (Attention, "attn_tc_d32_kw2"),
    AttnTcD64Kw2 => (Attention, "attn_tc_d64_kw2"),
    AttnTcD128Kw2 => (Attention, "attn_tc_d128_kw2"),
    AttnH16D32Kw4 => (Attention, "attn_h16_d32_kw4"),
    AttnH16D64Kw4 => (Attention, "attn_h16_d64_kw4"),
    AttnH16D128Kw4 => (Attention, "attn_h16_d128_kw4"),
    AttnH16KvD32Kw4 => (Attention, "attn_h16kv_d32_kw4"),
    AttnH16KvD64Kw4 => (Attention, "attn_h16kv_d64_kw4"),
    AttnH16KvD128Kw4 => (Attention, "attn_h16kv_d128_kw4"),
    AttnFa16KvD32 => (Attention, "attn_fa16kv_d32"),
    AttnFa16KvD64 => (Attention, "attn_fa16kv_d64"),
    AttnFa16KvD128 => (Attention, "attn_fa16kv_d128"),
    AttnPfD32X3 => (Attention, "attn_pf_d32_x3"),
    AttnPfD32X1 => (Attention, "attn_pf_d32_x1"),
    AttnPfD64X3 => (Attention, "attn_pf_d64_x3"),
    AttnPfD64X1 => (Attention, "attn_pf_d64_x1"),
    AttnPfD128X3 => (Attention, "attn_pf_d128_x3"),
    AttnPfD128X1 => (Attention, "attn_pf_d128_x1"),
    AttnPf2D256X3 => (Attention, "attn_pf2_d256_x3"),
    AttnPf2D256X1 => (Attention, "attn_pf2_d256_x1"),
    AttnPf2D256X3S3 => (Attention, "attn_pf2_d256_x3_s3"),
    AttnPf2D256X1C64 => (Attention, "attn_pf2_d256_x1_c64"),
    AttnPf2D256X1S3 => (Attention, "attn_pf2_d256_x1_s3"),
    AttnPf2D256X1R8 => (Attention, "attn_pf2_d256_x1_r8"),
    // The Q8_0A8 matmul kernels compiled for Q4_0A8 weights (`Kernel::q4_twin`).
    Q4A8N1W1 => (MatmulQ4, "a8_n1_w1"),
    Q4A8N1W2 => (MatmulQ4, "a8_n1_w2"),
    Q4A8N1W4 => (MatmulQ4, "a8_n1_w4"),
    Q4A8N2W1 => (MatmulQ4, "a8_n2_w1"),
    Q4A8N2W2 => (MatmulQ4, "a8_n2_w2"),
    Q4A8N2W4 => (MatmulQ4, "a8_n2_w4"),
    Q4A8KN1W1K4S3 => (MatmulQ4, "a8k_n1_w1_k4_s3"),
    Q4A8KN1W1K2S3 => (MatmulQ4, "a8k_n1_w1_k2_s3"),
    Q4A8KN1W2K2S4 => (MatmulQ4, "a8k_n1_w2_k2_s4"),
    Q4A8KN1W2K4S3 => (MatmulQ4, "a8k_n1_w2_k4_s3"),
    Q4A8KN1W2K4S2 => (MatmulQ4, "a8k_n1_w2_k4_s2"),
    Q4A8KN1W4K1S3 => (MatmulQ4, "a8k_n1_w4_k1_s3"),
    Q4A8KN1W4K2S3 => (MatmulQ4, "a8k_n1_w4_k2_s3"),
    Q4A8KN1W4K2S2 => (MatmulQ4, "a8k_n1_w4_k2_s2"),
    Q4A8KN1W4K4S2 => (MatmulQ4, "a8k_n1_w4_k4_s2"),
    Q4A8KN2W1K4S3 => (MatmulQ4, "a8k_n2_w1_k4_s3"),
    Q4A8KN2W1K2S3 => (MatmulQ4, "a8k_n2_w1_k2_s3"),
    Q4A8KN2W2K2S4 => (MatmulQ4, "a8k_n2_w2_k2_s4"),
    Q4A8KN2W2K4S3 => (MatmulQ4, "a8k_n2_w2_k4_s3"),
    Q4A8KN2W2K4S2 => (MatmulQ4, "a8k_n2_w2_k4_s2"),
    Q4A8KN2W4K1S3 => (MatmulQ4, "a8k_n2_w4_k1_s3"),
    Q4A8KN2W4K2S3 => (MatmulQ4, "a8k_n2_w4_k2_s3"),
    Q4A8KN2W4K2S2 => (MatmulQ4, "a8k_n2_w4_k2_s2"),
    Q4A8KN2W4K4S2 => (MatmulQ4, "a8k_n2_w4_k4_s2"),
    Q4A8KPN1W4K2S2 => (MatmulQ4, "a8kp_n1_w4_k2_s2"),
    Q4A8KPN2W4K2S2 => (MatmulQ4, "a8kp_n2_w4_k2_s2"),
    Q4A8KPN1W4K1S3 => (MatmulQ4, "a8kp_n1_w4_k1_s3"),
    Q4A8KPN2W4K1S3 => (MatmulQ4, "a8kp_n2_w4_k1_s3"),
    Q4A8KPN1W4K1S2 => (MatmulQ4, "a8kp_n1_w4_k1_s2"),
    Q4A8KPN2W4K1S2 => (MatmulQ4, "a8kp_n2_w4_k1_s2"),
    Q4A8KPQN1W4K1S2 => (MatmulQ4, "a8kpq_n1_w4_k1_s2"),
    Q4A8KPQN2W4K1S2 => (MatmulQ4, "a8kpq_n2_w4_k1_s2"),
    AttnWg16KvD128 => (Attention, "attn_wg16kv_d128"),
    AttnTcD32Kw4 => (Attention, "attn_tc_d32_kw4"),
    AttnTcD64Kw4 => (Attention, "attn_tc_d64_kw4"),
    AttnTcD128Kw4 => (Attention, "attn_tc_d128_kw4"),
    AttnTcD32Kw2Fpv => (Attention, "attn_tc_d32_kw2_fpv"),
    AttnTcD64Kw2Fpv => (Attention, "attn_tc_d64_kw2_fpv"),
    AttnTcD128Kw2Fpv => (Attention, "attn_tc_d128_kw2_fpv"),
    AttnTcD32Kw4Fpv => (Attention, "attn_tc_d32_kw4_fpv"),
    AttnTcD64Kw4Fpv => (Attention, "attn_tc_d64_kw4_fpv"),
    AttnTcD128Kw4Fpv => (Attention, "attn_tc_d128_kw4_fpv"),
    AttnTcD32Kw2X1 => (Attention, "attn_tc_d32_kw2_x1"),
    AttnTcD64Kw2X1 => (Attention, "attn_tc_d64_kw2_x1"),
    AttnTcD128Kw2X1 => (Attention, "attn_tc_d128_kw2_x1"),
    AttnTcD32Kw4X1 => (Attention, "attn_tc_d32_kw4_x1"),
    AttnTcD64Kw4X1 => (Attention, "attn_tc_d64_kw4_x1"),
    AttnTcD128Kw4X1 => (Attention, "attn_tc_d128_kw4_x1"),
    AttnTcD256Kw2 => (Attention, "attn_tc_d256_kw2"),
    AttnTcD256Kw2X1 => (Attention, "attn_tc_d256_kw2_x1"),
    AttnCombine => (Attention, "attn_combine"),
    AttnCombineWide => (Attention, "attn_combine_wide"),
    AttnSoftmaxRows => (Attention, "attn_softmax_rows"),
    AttnSoftmaxRowsP16 => (Attention, "attn_softmax_rows_p16"),
    AttnGemmOperand => (Attention, "attn_gemm_operand"),
    AttnGemmReduce => (Attention, "attn_gemm_reduce"),
    AttnGeneric => (Attention, "attn_generic"),
}

impl Kernel {
    /// The same Q8_0A8 matmul kernel compiled for [`WeightFormat::Q4_0A8`] weights (module
    /// [`Module::MatmulQ4`]: the same source, launch parameters and shared memory; only the
    /// weights' bytes per block and their widening differ); `None` for every other kernel.
    ///
    /// [`WeightFormat::Q4_0A8`]: dflash_backend::WeightFormat::Q4_0A8
    pub fn q4_twin(self) -> Option<Kernel> {
        Some(match self {
            Kernel::A8N1W1 => Kernel::Q4A8N1W1,
            Kernel::A8N1W2 => Kernel::Q4A8N1W2,
            Kernel::A8N1W4 => Kernel::Q4A8N1W4,
            Kernel::A8N2W1 => Kernel::Q4A8N2W1,
            Kernel::A8N2W2 => Kernel::Q4A8N2W2,
            Kernel::A8N2W4 => Kernel::Q4A8N2W4,
            Kernel::A8KN1W1K4S3 => Kernel::Q4A8KN1W1K4S3,
            Kernel::A8KN1W1K2S3 => Kernel::Q4A8KN1W1K2S3,
            Kernel::A8KN1W2K2S4 => Kernel::Q4A8KN1W2K2S4,
            Kernel::A8KN1W2K4S3 => Kernel::Q4A8KN1W2K4S3,
            Kernel::A8KN1W2K4S2 => Kernel::Q4A8KN1W2K4S2,
            Kernel::A8KN1W4K1S3 => Kernel::Q4A8KN1W4K1S3,
            Kernel::A8KN1W4K2S3 => Kernel::Q4A8KN1W4K2S3,
            Kernel::A8KN1W4K2S2 => Kernel::Q4A8KN1W4K2S2,
            Kernel::A8KN1W4K4S2 => Kernel::Q4A8KN1W4K4S2,
            Kernel::A8KN2W1K4S3 => Kernel::Q4A8KN2W1K4S3,
            Kernel::A8KN2W1K2S3 => Kernel::Q4A8KN2W1K2S3,
            Kernel::A8KN2W2K2S4 => Kernel::Q4A8KN2W2K2S4,
            Kernel::A8KN2W2K4S3 => Kernel::Q4A8KN2W2K4S3,
            Kernel::A8KN2W2K4S2 => Kernel::Q4A8KN2W2K4S2,
            Kernel::A8KN2W4K1S3 => Kernel::Q4A8KN2W4K1S3,
            Kernel::A8KN2W4K2S3 => Kernel::Q4A8KN2W4K2S3,
            Kernel::A8KN2W4K2S2 => Kernel::Q4A8KN2W4K2S2,
            Kernel::A8KN2W4K4S2 => Kernel::Q4A8KN2W4K4S2,
            Kernel::A8KPN1W4K2S2 => Kernel::Q4A8KPN1W4K2S2,
            Kernel::A8KPN2W4K2S2 => Kernel::Q4A8KPN2W4K2S2,
            Kernel::A8KPN1W4K1S3 => Kernel::Q4A8KPN1W4K1S3,
            Kernel::A8KPN2W4K1S3 => Kernel::Q4A8KPN2W4K1S3,
            Kernel::A8KPN1W4K1S2 => Kernel::Q4A8KPN1W4K1S2,
            Kernel::A8KPN2W4K1S2 => Kernel::Q4A8KPN2W4K1S2,
            Kernel::A8KPQN1W4K1S2 => Kernel::Q4A8KPQN1W4K1S2,
            Kernel::A8KPQN2W4K1S2 => Kernel::Q4A8KPQN2W4K1S2,
            _ => return None,
        })
    }

    /// The one NVRTC target that has this kernel, for those that use instructions of one
    /// architecture only (Hopper's warpgroup MMA: `sm_90a`, see [`module_arch`]); `None`: every
    /// target.
    pub fn only_for(self) -> Option<&'static str> {
        match self {
            Kernel::AttnWg16KvD128 => Some("sm_90a"),
            _ => None,
        }
    }
}

/// The NVRTC target a module is compiled for on a device whose target is `arch`: the attention
/// module for `sm_90a` on `sm_90` (compute capability 9.0: H100 / H200), where it also has the
/// warpgroup-MMA kernel; everything else for `arch`. `sm_90a` code runs on 9.0 devices only,
/// which is exactly where it is chosen.
pub fn module_arch(m: Module, arch: &'static str) -> &'static str {
    if m == Module::Attention && arch == "sm_90" {
        "sm_90a"
    } else {
        arch
    }
}

/// Build module `m` (`build`: compile and load for a target) for [`module_arch`]`(m, base)`,
/// and where that architecture-specific target fails (an NVRTC or driver that predates it),
/// for `base` instead: its architecture-specific kernels are then missing (`Registry::has`),
/// every other kernel is there. Returns the target used.
fn build_with_fallback<T>(
    m: Module,
    base: &'static str,
    mut build: impl FnMut(&'static str) -> Result<T, CudaError>,
) -> Result<(&'static str, T), CudaError> {
    let want = module_arch(m, base);
    match build(want) {
        Ok(t) => Ok((want, t)),
        Err(e) if want != base => {
            tracing::warn!(
                module = m.name(),
                arch = want,
                fallback = base,
                error = %e,
                "architecture-specific build failed: its kernels are unavailable"
            );
            Ok((base, build(base)?))
        }
        Err(e) => Err(e),
    }
}

/// NVRTC target name for a compute capability (`sm_90` for (9, 0)).
pub fn arch_for(major: i32, minor: i32) -> Result<&'static str, CudaError> {
    Ok(match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (10, 3) => "sm_103",
        (12, 0) => "sm_120",
        (12, 1) => "sm_121",
        _ => {
            return Err(CudaError::Unsupported {
                op: "nvrtc",
                msg: format!(
                    "compute capability {major}.{minor} (the kernels need sm_80 or newer)"
                ),
            })
        }
    })
}

/// Compile one module to PTX for `arch` (e.g. `"sm_90"`). No device is needed.
pub fn compile_module(module: Module, arch: &'static str) -> Result<Ptx, CudaError> {
    compile_module_traced(module, arch, false)
}

/// [`compile_module`], with the per-block trace records compiled in when `block_trace`
/// (`CudaOptions::block_trace`).
pub fn compile_module_traced(
    module: Module,
    arch: &'static str,
    block_trace: bool,
) -> Result<Ptx, CudaError> {
    let mut options = vec!["--std=c++17".to_string()];
    if arch == "sm_90a" {
        // The kernels that need the architecture-specific instructions (`Kernel::only_for`).
        options.push("-DDFLASH_SM90A".into());
    }
    if block_trace {
        options.push("-DDFLASH_BLOCK_TRACE".into());
    }
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(format!("{}.cu", module.name())),
        options,
        ..Default::default()
    };
    Ok(compile_ptx_with_opts(module.full_source(), opts)?)
}

/// Whether the NVRTC library can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes dlopen on the candidate library names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The shared-memory carveout the Q8_0A8 matmul kernels (`a8*`) prefer by default: all of the
/// shared memory the device allows. These kernels follow each other through programmatic
/// dependent launches, their blocks sharing the multiprocessors; where two of them prefer
/// different splits of L1 and shared memory, a multiprocessor changes its split only once it
/// has drained, and blocks that the new split would hold wait until then (H200, per-block
/// trace: a 4-per-SM launch after a 3-per-SM one ran 3 per SM on a few SMs, the fourth block
/// starting when the other three had ended). They read their activations through shared
/// memory, not L1.
pub const SMEM_CARVEOUT_A8: i32 = 100;

/// The carveout every other kernel prefers by default: the driver's choice. The bf16 / q8_0 /
/// q4_0 skinny matmuls read their activation rows through L1, and lose it under the largest
/// carveout (H200: the 8B q8_0 draft step 1.33 -> 1.98 ms, the dense target's verify16 6.8 ->
/// 8.7 ms with every kernel at 100).
pub const SMEM_CARVEOUT_OTHER: i32 = -1;

/// The preferred carveout of kernel `k` under the (Q8_0A8, other) pair `co`. The chunked delta
/// rule's state and output kernels always prefer all of it: their blocks of 88 / 72 KB run two
/// / three per SM only there.
fn carveout_of(k: Kernel, co: (i32, i32)) -> i32 {
    if matches!(k, Kernel::GdnChunkState | Kernel::GdnChunkOut) {
        100
    } else if k.name().starts_with("a8") {
        co.0
    } else {
        co.1
    }
}

/// A carveout is -1 (the driver's choice) or a percentage.
fn check_carveout(what: &str, v: i32) -> Result<(), CudaError> {
    if (-1..=100).contains(&v) {
        Ok(())
    } else {
        Err(CudaError::Unsupported {
            op: "set_smem_carveout",
            msg: format!("{what} carveout {v}: expected -1 (the driver's choice) or 0..=100"),
        })
    }
}

fn set_carveout(f: &CudaFunction, percent: i32) -> Result<(), CudaError> {
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        percent,
    )?;
    Ok(())
}

/// Per-context cache: modules compiled and loaded at first use, functions looked up once.
pub(crate) struct Registry {
    ctx: Arc<CudaContext>,
    arch: &'static str,
    block_trace: bool,
    /// Each loaded module with the target it was compiled for.
    modules: Mutex<HashMap<Module, (Arc<CudaModule>, &'static str)>>,
    functions: Mutex<HashMap<Kernel, CudaFunction>>,
    /// The preferred shared-memory carveouts, (Q8_0A8 matmuls, other kernels)
    /// ([`Registry::set_carveout`]).
    carveout: Mutex<(i32, i32)>,
}

impl Registry {
    pub(crate) fn new(ctx: Arc<CudaContext>, arch: &'static str, block_trace: bool) -> Self {
        Registry {
            ctx,
            arch,
            block_trace,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            carveout: Mutex::new((SMEM_CARVEOUT_A8, SMEM_CARVEOUT_OTHER)),
        }
    }

    /// The preferred shared-memory carveouts (percent of the most the device allows; -1: the
    /// driver's choice) of the Q8_0A8 matmuls and of every other kernel: the kernels loaded so
    /// far and those loaded later.
    pub(crate) fn set_carveout(&self, a8: i32, other: i32) -> Result<(), CudaError> {
        // Checked before any kernel changes, so a bad value leaves every carveout as it was.
        check_carveout("Q8_0A8", a8)?;
        check_carveout("other", other)?;
        let mut c = self.carveout.lock().unwrap_or_else(|p| p.into_inner());
        let fns = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        for (&k, f) in fns.iter() {
            set_carveout(f, carveout_of(k, (a8, other)))?;
        }
        *c = (a8, other);
        Ok(())
    }

    pub(crate) fn arch(&self) -> &'static str {
        self.arch
    }

    /// Module `m`, compiled and loaded at first use, with the target it was compiled for.
    fn module(&self, m: Module) -> Result<(Arc<CudaModule>, &'static str), CudaError> {
        let mut mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(md) = mods.get(&m) {
            return Ok(md.clone());
        }
        let t0 = std::time::Instant::now();
        let (arch, md) = build_with_fallback(m, self.arch, |arch| {
            let ptx = compile_module_traced(m, arch, self.block_trace)?;
            Ok(self.ctx.load_module(ptx)?)
        })?;
        tracing::debug!(
            module = m.name(),
            arch,
            ms = t0.elapsed().as_millis() as u64,
            "compiled CUDA module"
        );
        mods.insert(m, (md.clone(), arch));
        Ok((md, arch))
    }

    /// Whether kernel `k` is in its module as compiled here (compiles the module at first use):
    /// always, except an architecture-specific kernel ([`Kernel::only_for`]) whose module fell
    /// back to the device's plain target, or was never compiled for that one.
    pub(crate) fn has(&self, k: Kernel) -> Result<bool, CudaError> {
        match k.only_for() {
            None => Ok(true),
            Some(arch) => Ok(
                module_arch(k.module(), self.arch) == arch && self.module(k.module())?.1 == arch
            ),
        }
    }

    pub(crate) fn get(&self, k: Kernel) -> Result<CudaFunction, CudaError> {
        {
            let fns = self.functions.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(f) = fns.get(&k) {
                return Ok(f.clone());
            }
        }
        let (md, _) = self.module(k.module())?;
        let f = md.load_function(k.name())?;
        let co = *self.carveout.lock().unwrap_or_else(|p| p.into_inner());
        set_carveout(&f, carveout_of(k, co))?;
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(k, f.clone());
        Ok(f)
    }
}

/// One record of the per-block trace (`CudaOptions::block_trace`): written by thread 0 of a
/// block when it waits for the kernel before it (`Wait`), or when a Q8_0A8 matmul block's main
/// loop has ended (`End`). Times are the device's global timer, ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockTraceRecord {
    /// The kernel's module (`"matmul"`, `"attention"`, `"elementwise"`, `"reduce"`).
    pub module: &'static str,
    /// The source line of the record's call in the module (with the kernel's name in the
    /// module's source, which kernel wrote it).
    pub line: u32,
    pub kind: BlockTraceKind,
    /// The multiprocessor the block ran on.
    pub sm: u32,
    /// Wait: when the block reached the wait (it was resident and had issued what precedes
    /// the wait); End: when the main loop ended.
    pub t0_ns: u64,
    /// Wait: when the wait returned (the previous kernel done, its writes visible); End: 0.
    pub t1_ns: u64,
    /// The linear block index (x fastest) and the grid's block count.
    pub block: u32,
    pub blocks: u32,
}

/// What a [`BlockTraceRecord`] marks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockTraceKind {
    Wait,
    End,
}

impl Registry {
    pub(crate) fn block_trace_enabled(&self) -> bool {
        self.block_trace
    }

    /// The modules loaded so far.
    fn loaded(&self) -> Vec<(Module, Arc<CudaModule>)> {
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, (md, _))| (*k, md.clone()))
            .collect()
    }

    /// Zero every loaded module's trace counter (on `st`).
    pub(crate) fn block_trace_reset(&self, st: &Arc<CudaStream>) -> Result<(), CudaError> {
        for (_, md) in self.loaded() {
            let mut n = md.get_global("bt_n", st)?;
            st.memset_zeros(&mut n)?;
        }
        Ok(())
    }

    /// Every loaded module's records (synchronizes `st`), and how many were dropped (past a
    /// module's buffer).
    pub(crate) fn block_trace_read(
        &self,
        st: &Arc<CudaStream>,
    ) -> Result<(Vec<BlockTraceRecord>, u64), CudaError> {
        let (mut out, mut dropped) = (Vec::new(), 0u64);
        for (m, md) in self.loaded() {
            let n: Vec<u8> = st.clone_dtoh(&md.get_global("bt_n", st)?)?;
            let n = n
                .get(..4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            let buf: Vec<u8> = st.clone_dtoh(&md.get_global("bt_buf", st)?)?;
            let cap = buf.len() / 32;
            dropped += (n as usize).saturating_sub(cap) as u64;
            for rec in buf.chunks_exact(32).take(n as usize) {
                let w = |i: usize| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&rec[i * 8..i * 8 + 8]);
                    u64::from_le_bytes(b)
                };
                let (tag, blk) = ((w(0) & 0xffff_ffff) as u32, w(3));
                out.push(BlockTraceRecord {
                    module: m.name(),
                    line: tag % 100_000,
                    kind: if tag >= 100_000 {
                        BlockTraceKind::End
                    } else {
                        BlockTraceKind::Wait
                    },
                    sm: (w(0) >> 32) as u32,
                    t0_ns: w(1),
                    t1_ns: w(2),
                    block: (blk & 0xffff_ffff) as u32,
                    blocks: (blk >> 32) as u32,
                });
            }
        }
        Ok((out, dropped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fail(arch: &str) -> CudaError {
        CudaError::Unsupported {
            op: "nvrtc",
            msg: format!("no {arch} here"),
        }
    }

    #[test]
    fn carveouts_outside_minus_one_to_100_are_refused() {
        for v in [-1, 0, 50, 100] {
            assert!(check_carveout("other", v).is_ok(), "{v}");
        }
        for v in [-2, 101, i32::MIN, i32::MAX] {
            let e = check_carveout("Q8_0A8", v).unwrap_err().to_string();
            assert!(e.contains(&format!("Q8_0A8 carveout {v}")), "{e}");
        }
    }

    /// The attention module on sm_90 is built for sm_90a; where that target fails (an older
    /// NVRTC or driver) it is built for sm_90 instead, and the failure of the plain target, or of
    /// a module with no architecture-specific target, is the error.
    #[test]
    fn an_architecture_specific_build_falls_back_to_the_plain_target() {
        let mut tried = Vec::new();
        let r = build_with_fallback(Module::Attention, "sm_90", |a| {
            tried.push(a);
            Ok(a.len())
        });
        assert_eq!(r.unwrap(), ("sm_90a", 6));
        assert_eq!(tried, ["sm_90a"]);

        tried.clear();
        let r = build_with_fallback(Module::Attention, "sm_90", |a| {
            tried.push(a);
            if a == "sm_90a" {
                Err(fail(a))
            } else {
                Ok(())
            }
        });
        assert_eq!(r.unwrap().0, "sm_90");
        assert_eq!(tried, ["sm_90a", "sm_90"]);

        let r = build_with_fallback(Module::Attention, "sm_90", |a| Err::<(), _>(fail(a)));
        assert!(matches!(r, Err(CudaError::Unsupported { msg, .. }) if msg == "no sm_90 here"));

        tried.clear();
        let r = build_with_fallback(Module::Matmul, "sm_90", |a| {
            tried.push(a);
            Err::<(), _>(fail(a))
        });
        assert!(r.is_err());
        assert_eq!(tried, ["sm_90"]);
        assert_eq!(
            build_with_fallback(Module::Attention, "sm_80", Ok).unwrap(),
            ("sm_80", "sm_80")
        );
    }
}

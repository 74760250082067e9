//! CI compile check: every kernel module compiles to PTX with NVRTC, no GPU needed, and
//! every registry entry names an entry point of its module.
//!
//! NVRTC is found through cudarc's dynamic loading (the loader's search path: on CI
//! `.ci/run` puts the `nvidia-cuda-nvrtc` wheel's lib directory on LD_LIBRARY_PATH). Where
//! no NVRTC can be loaded the test prints why and returns without checking anything.

use dflash_cuda_kernels::registry::{
    compile_module, compile_module_traced, module_arch, nvrtc_available, Kernel, Module,
};

#[test]
fn every_kernel_compiles_to_ptx() {
    if !nvrtc_available() {
        eprintln!(
            "SKIPPED every_kernel_compiles_to_ptx: libnvrtc could not be loaded (LD_LIBRARY_PATH={:?}); \
             install the PyPI wheel nvidia-cuda-nvrtc and put its nvidia/cu13/lib on LD_LIBRARY_PATH",
            std::env::var("LD_LIBRARY_PATH").ok()
        );
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        for m in Module::ALL {
            let t0 = std::time::Instant::now();
            let ptx =
                compile_module(m, arch).unwrap_or_else(|e| panic!("{} for {arch}: {e}", m.name()));
            let text = ptx.to_src();
            for k in Kernel::ALL
                .iter()
                .filter(|k| k.module() == m && k.only_for().is_none())
            {
                let entry = format!(".entry {}(", k.name());
                assert!(
                    text.contains(&entry),
                    "{}: no entry point {} in the PTX for {arch}",
                    m.name(),
                    k.name()
                );
            }
            // The tensor-core kernels must really use mma (not silently fall back).
            if m == Module::Matmul {
                assert!(
                    text.contains("mma.sync.aligned.m16n8k16"),
                    "matmul PTX has no mma.sync for {arch}"
                );
            }
            // The Q4_0A8 twins: the int8 mma, and none of matmul.cu's other kernels.
            if m == Module::MatmulQ4 {
                assert!(
                    text.contains("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"),
                    "matmul_q4 PTX has no int8 mma for {arch}"
                );
                assert!(!text.contains(".entry skinny") && !text.contains(".entry markov"));
            }
            eprintln!(
                "{arch} {:<12} {:>8} bytes of PTX in {:?}",
                m.name(),
                text.len(),
                t0.elapsed()
            );
        }
    }
}

/// The attention module as compiled for compute capability 9.0 (`module_arch`: sm_90a) has
/// every kernel of sm_90 plus the warpgroup-MMA one, which really runs wgmma; sm_90 has none.
#[test]
fn the_sm90a_attention_module_has_the_wgmma_kernel() {
    if !nvrtc_available() {
        eprintln!(
            "SKIPPED the_sm90a_attention_module_has_the_wgmma_kernel: libnvrtc could not be loaded"
        );
        return;
    }
    let m = Module::Attention;
    let arch = module_arch(m, "sm_90");
    assert_eq!(arch, "sm_90a");
    let text = compile_module(m, arch)
        .unwrap_or_else(|e| panic!("attention for {arch}: {e}"))
        .to_src();
    for k in Kernel::ALL.iter().filter(|k| k.module() == m) {
        assert!(
            text.contains(&format!(".entry {}(", k.name())),
            "no entry point {} in the attention PTX for {arch}",
            k.name()
        );
    }
    assert!(text.contains("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16"));
    assert!(text.contains("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16"));
    let plain = compile_module(m, "sm_90").unwrap().to_src();
    assert!(!plain.contains("wgmma") && !plain.contains(".entry attn_wg16kv_d128("));
    // Every other module keeps the device's own target.
    for other in Module::ALL.into_iter().filter(|&o| o != m) {
        assert_eq!(module_arch(other, "sm_90"), "sm_90");
    }
    assert_eq!(module_arch(m, "sm_80"), "sm_80");
}

/// The modules with the per-block trace compiled in (`CudaOptions::block_trace`): they compile
/// for sm_90, and the trace really is in the PTX (the record's SM register and global timer
/// reads, the record buffer), in every module; the plain modules have none of it.
#[test]
fn the_block_trace_variant_compiles_and_records() {
    if !nvrtc_available() {
        eprintln!(
            "SKIPPED the_block_trace_variant_compiles_and_records: libnvrtc could not be loaded"
        );
        return;
    }
    for m in Module::ALL {
        let traced = compile_module_traced(m, module_arch(m, "sm_90"), true)
            .unwrap_or_else(|e| panic!("{} traced: {e}", m.name()))
            .to_src();
        let plain = compile_module(m, "sm_90")
            .unwrap_or_else(|e| panic!("{}: {e}", m.name()))
            .to_src();
        assert!(
            traced.contains("%globaltimer")
                && traced.contains("%smid")
                && traced.contains("bt_buf"),
            "{}: no trace records in the traced PTX",
            m.name()
        );
        assert!(
            !plain.contains("%globaltimer") && !plain.contains("bt_buf"),
            "{}: trace records or their buffer in the plain PTX",
            m.name()
        );
    }
}

#[test]
fn a_broken_kernel_is_a_compile_error() {
    if !nvrtc_available() {
        eprintln!("SKIPPED a_broken_kernel_is_a_compile_error: libnvrtc could not be loaded");
        return;
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90"),
        ..Default::default()
    };
    let r = cudarc::nvrtc::compile_ptx_with_opts(
        "extern \"C\" __global__ void k(float *x) { x[0] = undefined_name; }",
        opts,
    );
    assert!(r.is_err(), "NVRTC accepted a kernel with an undefined name");
}

#[test]
fn split_kernels_launch_bounds_pin_the_occupancy_the_host_counts_on() {
    // matmul.cu's A8K_MINB: where the blocks per SM that the host's shared memory per block
    // allows (+ the 1 KiB the driver reserves each, at most 2048 threads) leave at most 64
    // registers per thread, the launch bound's minimum is that count (`.minnctapersm` in the
    // PTX), elsewhere none: the kernel's copy of the shared-memory formula against the host's.
    if !nvrtc_available() {
        eprintln!(
            "SKIPPED split_kernels_launch_bounds_pin_the_occupancy_the_host_counts_on: libnvrtc could not be loaded"
        );
        return;
    }
    // The Q8_0A8 kernels and their Q4_0A8 twins (the same names in their own module).
    let ptxs: Vec<(Module, String)> = [Module::Matmul, Module::MatmulQ4]
        .into_iter()
        .map(|m| {
            let p = compile_module(m, "sm_90").expect("matmul for sm_90");
            (m, p.to_src())
        })
        .collect();
    let min_in_ptx = |k: dflash_cuda_kernels::registry::Kernel| -> Option<usize> {
        let name = k.name();
        let ptx = &ptxs
            .iter()
            .find(|(m, _)| *m == k.module())
            .expect("a matmul module")
            .1;
        let at = ptx
            .find(&format!(".entry {name}("))
            .unwrap_or_else(|| panic!("no entry {name}"));
        let end = at + ptx[at..].find('{').expect("a kernel body");
        ptx[at..end]
            .lines()
            .find_map(|l| l.trim().strip_prefix(".minnctapersm "))
            .map(|n| n.trim().parse().expect(".minnctapersm count"))
    };
    // The H100 / H200 shared memory per multiprocessor (A8_SM_SMEM for sm_90).
    let sm = 228 * 1024;
    let mut bound = Vec::new();
    for (k, threads, smem) in dflash_cuda_kernels::a8_split_kernel_shapes() {
        let occ = (sm / (smem + 1024)).min(2048 / threads);
        let want = (occ * threads * 64 >= 65536).then_some(occ);
        assert_eq!(
            min_in_ptx(k),
            want,
            "{} ({}): {threads} threads, {smem} B",
            k.name(),
            k.module().name()
        );
        if let Some(b) = want {
            bound.push((k.name(), b));
        }
    }
    // The lm_heads' 4 x 2 x 2 blocks and the 27B gate / up's 2-stage pairs are among them.
    assert!(bound.contains(&("a8k_n2_w4_k2_s2", 2)), "{bound:?}");
    assert!(bound.contains(&("a8kp_n2_w4_k1_s2", 5)), "{bound:?}");
}

//! `cargo xtask regs [FILTER]`: the registers and spills of every kernel as ptxas compiles
//! them, without a GPU.
//!
//! Register counts decide how many blocks an SM holds, and so how many waves a launch takes
//! (the fifty-eighth to sixtieth sessions: the 8B gate / up at one row took one wave at 78
//! registers and 1.16 at 96). The device's driver compiles the PTX that NVRTC makes; NVRTC
//! 13.0 and ptxas 13.0 here (the PyPI wheels `nvidia-cuda-nvrtc==13.0.*` and
//! `nvidia-cuda-nvcc==13.0.*`) gave every skinny kernel the count `bench gpu --kernel-info`
//! read from an H100's driver 580 (CUDA 13.0), the spill's stack frame included. So a kernel
//! change can be judged by its registers before it reaches a GPU. NVRTC is loaded as the
//! library loads it (put the wheel's `nvidia/cu13/lib` on `LD_LIBRARY_PATH`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use dflash_cuda_kernels::registry::{compile_module, module_arch, nvrtc_available, Kernel, Module};

#[derive(clap::Args)]
pub struct RegsArgs {
    /// Only entry points containing this (all by default).
    #[arg(default_value = "")]
    filter: String,
    /// The NVRTC / ptxas target of the device (sm_90: H100 / H200; the attention module is
    /// built for sm_90a there, as the registry builds it).
    #[arg(long, default_value = "sm_90")]
    arch: String,
    /// The ptxas to run: its version should be the device driver's CUDA version.
    #[arg(long, default_value = "ptxas")]
    ptxas: PathBuf,
}

/// One entry point as ptxas reports it.
#[derive(Debug, PartialEq, Eq)]
struct EntryRegs {
    name: String,
    registers: u32,
    /// Bytes of stack per thread (the local memory the driver reports for the kernel).
    stack: u32,
    spill_stores: u32,
    /// Static shared memory per block, bytes.
    smem: u32,
}

/// The entry points of ptxas' `-v` report, in its order.
fn parse_ptxas_verbose(log: &str) -> Vec<EntryRegs> {
    let mut out = Vec::new();
    let mut cur: Option<EntryRegs> = None;
    // Whose "Function properties" the next stack / spill line gives (device functions that
    // were not inlined have their own).
    let mut props_of_cur = false;
    let num_before = |line: &str, what: &str| -> Option<u32> {
        let at = line.find(what)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            out.extend(cur.take());
            let name = rest.split('\'').next().unwrap_or("").to_string();
            cur = Some(EntryRegs {
                name,
                registers: 0,
                stack: 0,
                spill_stores: 0,
                smem: 0,
            });
            props_of_cur = false;
        } else if let Some(e) = cur.as_mut() {
            if let Some(f) = line.split("Function properties for ").nth(1) {
                props_of_cur = f.trim() == e.name;
            } else if props_of_cur && line.contains("bytes stack frame") {
                e.stack = num_before(line, "bytes stack frame").unwrap_or(0);
                e.spill_stores = num_before(line, "bytes spill stores").unwrap_or(0);
            } else if let Some(n) = line
                .split("Used ")
                .nth(1)
                .and_then(|r| num_before(r, "registers"))
            {
                e.registers = n;
                e.smem = num_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out.extend(cur);
    out
}

/// The block size a kernel's `__launch_bounds__` fixes (`.maxntid` in the PTX), by entry.
fn maxntid(ptx: &str, entry: &str) -> Option<u32> {
    let at = ptx.find(&format!(".entry {entry}("))?;
    let end = at + ptx[at..].find('{')?;
    ptx[at..end].lines().find_map(|l| {
        let v = l.trim().strip_prefix(".maxntid ")?;
        v.split(',').next()?.trim().parse().ok()
    })
}

/// Blocks of `threads` threads an sm_80 / sm_90 SM holds at `regs` registers per thread and
/// `smem` bytes of static shared memory per block: registers go to warps in units of 256
/// (65536 per SM), an SM holds at most 2048 threads and 32 blocks, and 228 KiB of shared
/// memory with 1 KiB reserved per block (sm_90; the dynamic shared memory of a launch is not
/// counted).
fn blocks_per_sm(regs: u32, threads: u32, smem: u32) -> u32 {
    let warps = threads.div_ceil(32).max(1);
    let per_warp = (regs.max(1) * 32).div_ceil(256) * 256;
    let by_regs = 65536 / (per_warp * warps);
    let by_smem = (228 * 1024) / (smem + 1024);
    by_regs.min(by_smem).min(2048 / (warps * 32)).min(32)
}

pub fn regs(a: RegsArgs) -> Result<()> {
    if !nvrtc_available() {
        bail!(
            "libnvrtc could not be loaded: install the PyPI wheel nvidia-cuda-nvrtc (13.0.* for \
             the GPU machine's driver) and put its nvidia/cu13/lib on LD_LIBRARY_PATH"
        );
    }
    let arch: &'static str = Box::leak(a.arch.clone().into_boxed_str());
    let dir = crate::Scratch::new("regs")?;
    println!(
        "| module | kernel | registers | stack bytes | spill stores | threads | blocks per SM |\n\
         |---|---|---:|---:|---:|---:|---:|"
    );
    // Only the modules with a registered kernel the filter matches (NVRTC takes most of the
    // time: ~2 min for all of them on two cores).
    let wanted = Module::ALL.into_iter().filter(|&m| {
        Kernel::ALL
            .iter()
            .any(|k| k.module() == m && k.name().contains(&a.filter))
    });
    for m in wanted {
        let march = module_arch(m, arch);
        let ptx =
            compile_module(m, march).with_context(|| format!("NVRTC: {} for {march}", m.name()))?;
        let path = dir.0.join(format!("{}.ptx", m.name()));
        std::fs::write(&path, ptx.to_src())?;
        let out = Command::new(&a.ptxas)
            .arg(format!("-arch={march}"))
            .arg("-v")
            .arg(&path)
            .arg("-o")
            .arg(dir.0.join(format!("{}.cubin", m.name())))
            .output()
            .with_context(|| {
                format!(
                    "running {} (--ptxas; the nvidia-cuda-nvcc wheel has one)",
                    a.ptxas.display()
                )
            })?;
        let log = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            bail!("ptxas failed on {} ({}):\n{log}", m.name(), out.status);
        }
        let text = ptx.to_src();
        for e in parse_ptxas_verbose(&log)
            .into_iter()
            .filter(|e| e.name.contains(&a.filter))
        {
            // Blocks per SM at the launch bound's block size, by registers and static shared
            // memory; "-" where the kernel has no bound (its block size is the launch's).
            let (threads, blocks) = match maxntid(&text, &e.name) {
                Some(t) => (
                    t.to_string(),
                    blocks_per_sm(e.registers, t, e.smem).to_string(),
                ),
                None => ("-".into(), "-".into()),
            };
            println!(
                "| {} | {} | {} | {} | {} | {threads} | {blocks} |",
                m.name(),
                e.name,
                e.registers,
                e.stack,
                e.spill_stores
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_verbose_report_parses_per_entry() {
        // ptxas 13.0's -v lines for two entries (the second spilling), around a non-entry.
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'skinny_glu_bf16_n2' for 'sm_90'
ptxas info    : Function properties for skinny_glu_bf16_n2
    208 bytes stack frame, 456 bytes spill stores, 384 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 208 bytes cumulative stack size, 8208 bytes smem
ptxas info    : Function properties for helper
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'skinny_bf16_n1' for 'sm_90'
ptxas info    : Function properties for skinny_bf16_n1
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 4112 bytes smem, 400 bytes cmem[0]
";
        assert_eq!(
            parse_ptxas_verbose(log),
            vec![
                EntryRegs {
                    name: "skinny_glu_bf16_n2".into(),
                    registers: 96,
                    stack: 208,
                    spill_stores: 456,
                    smem: 8208
                },
                EntryRegs {
                    name: "skinny_bf16_n1".into(),
                    registers: 80,
                    stack: 0,
                    spill_stores: 0,
                    smem: 4112
                },
            ]
        );
    }

    #[test]
    fn blocks_per_sm_follow_the_register_file() {
        // 128 threads: 72 registers hold 7 blocks, 80 six, 96 five (the skinny kernels).
        assert_eq!(blocks_per_sm(72, 128, 4112), 7);
        assert_eq!(blocks_per_sm(80, 128, 4112), 6);
        assert_eq!(blocks_per_sm(96, 128, 8208), 5);
        // 81 registers round up to 88 per thread: 5 blocks.
        assert_eq!(blocks_per_sm(81, 128, 0), 5);
        // Threads bound: 32 registers, 256 threads: 8 blocks (2048 threads).
        assert_eq!(blocks_per_sm(32, 256, 0), 8);
        // Shared memory bound: 100 KB static: 2 blocks.
        assert_eq!(blocks_per_sm(32, 128, 100 * 1024), 2);
    }

    #[test]
    fn maxntid_reads_the_entry_s_own_bound() {
        let ptx = ".visible .entry a(\n.param .u32 x\n)\n.maxntid 128, 1, 1\n{\n}\n\
                   .visible .entry b(\n.param .u32 x\n)\n{\n}\n";
        assert_eq!(maxntid(ptx, "a"), Some(128));
        assert_eq!(maxntid(ptx, "b"), None);
        assert_eq!(maxntid(ptx, "c"), None);
    }
}

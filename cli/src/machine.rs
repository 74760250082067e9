//! The machine a measurement ran on (named in `dflash bench` output).

use dflash_backend::cpu::Cpu;
use dflash_cuda_kernels::Cuda;

/// CPU model, logical CPUs, load average at the start, and the backend: CPU threads and
/// instruction set, or the GPU.
pub struct Machine {
    pub cpu: String,
    pub logical_cpus: usize,
    pub loadavg: Option<f64>,
    pub backend: BackendInfo,
}

pub enum BackendInfo {
    Cpu {
        threads: usize,
        isa: String,
    },
    Cuda {
        gpu: String,
        arch: String,
        sms: usize,
    },
}

impl Machine {
    fn host(backend: BackendInfo) -> Machine {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = info
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let logical_cpus = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let loadavg = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()));
        Machine {
            cpu,
            logical_cpus,
            loadavg,
            backend,
        }
    }

    pub fn cpu(be: &Cpu) -> Machine {
        Machine::host(BackendInfo::Cpu {
            threads: be.threads(),
            isa: format!("{:?}", be.isa()),
        })
    }

    pub fn cuda(be: &Cuda) -> Machine {
        Machine::host(BackendInfo::Cuda {
            gpu: be
                .context()
                .name()
                .unwrap_or_else(|e| format!("(device name unavailable: {e})")),
            arch: be.arch().to_string(),
            sms: be.num_sms(),
        })
    }

    pub fn describe(&self) -> String {
        let load = self
            .loadavg
            .map(|l| format!(", load average {l:.2} at start"))
            .unwrap_or_default();
        let host = format!("{} ({} logical CPUs)", self.cpu, self.logical_cpus);
        match &self.backend {
            BackendInfo::Cpu { threads, isa } => {
                format!("{host}, {threads} backend threads, {isa}{load}")
            }
            BackendInfo::Cuda { gpu, arch, sms } => {
                format!("{gpu} ({sms} SMs, {arch}), CUDA backend; host {host}{load}")
            }
        }
    }

    pub fn json(&self) -> serde_json::Value {
        let mut o = serde_json::json!({
            "cpu": self.cpu,
            "logical_cpus": self.logical_cpus,
            "loadavg": self.loadavg,
        });
        match &self.backend {
            BackendInfo::Cpu { threads, isa } => {
                o["backend"] = "cpu".into();
                o["threads"] = (*threads).into();
                o["isa"] = isa.clone().into();
            }
            BackendInfo::Cuda { gpu, arch, sms } => {
                o["backend"] = "cuda".into();
                o["gpu"] = gpu.clone().into();
                o["arch"] = arch.clone().into();
                o["sms"] = (*sms).into();
            }
        }
        o
    }
}

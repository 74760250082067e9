//! The machine a measurement ran on (named in `dflash bench` output).

use dflash_backend::cpu::Cpu;

/// CPU model, logical CPUs, backend threads and instruction set, load average at the start.
pub struct Machine {
    pub cpu: String,
    pub logical_cpus: usize,
    pub threads: usize,
    pub isa: String,
    pub loadavg: Option<f64>,
}

impl Machine {
    pub fn probe(be: &Cpu) -> Machine {
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
            threads: be.threads(),
            isa: format!("{:?}", be.isa()),
            loadavg,
        }
    }

    pub fn describe(&self) -> String {
        let load = self
            .loadavg
            .map(|l| format!(", load average {l:.2} at start"))
            .unwrap_or_default();
        format!(
            "{} ({} logical CPUs), {} backend threads, {}{load}",
            self.cpu, self.logical_cpus, self.threads, self.isa
        )
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "cpu": self.cpu,
            "logical_cpus": self.logical_cpus,
            "threads": self.threads,
            "isa": self.isa,
            "loadavg": self.loadavg,
        })
    }
}

//! How many cores the whole machine kept busy during a measurement.

/// Machine-wide CPU time from `/proc/stat`: how many cores every process together kept
/// busy. On a machine shared by PostgreSQL, the broker and the relay this shows whether a
/// limit is the CPU itself.
pub(crate) struct MachineCpu {
    busy: u64,
    total: u64,
}

impl MachineCpu {
    pub(crate) fn now() -> MachineCpu {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        let total: u64 = ticks.iter().take(8).sum();
        // user nice system idle iowait irq softirq steal: idle and iowait are not busy.
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        MachineCpu {
            busy: total - idle,
            total,
        }
    }

    /// Cores busy on average since `self` was read.
    pub(crate) fn busy_since(&self) -> f64 {
        let now = MachineCpu::now();
        let total = now.total.saturating_sub(self.total);
        if total == 0 {
            return 0.0;
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        cores * now.busy.saturating_sub(self.busy) as f64 / total as f64
    }
}

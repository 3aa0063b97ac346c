//! CPU time: how many cores the whole machine kept busy during a measurement, and what
//! some processes and PostgreSQL used.

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

/// CPU seconds (user + system) of process `pid`, from `/proc`.
pub(crate) fn cpu_secs(pid: u32) -> f64 {
    let ticks = stat_fields(pid);
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
    (ticks.get(11).unwrap_or(&0) + ticks.get(12).unwrap_or(&0)) as f64 / clock_ticks()
}

/// CPU seconds of every `postgres` process on the machine (the benchmark's cluster is the
/// only one), the backends that have exited included: the postmaster waits for each, and
/// their times add to its children's (`cutime`, `cstime`). A pgbench run's sessions end
/// with it, so without them its writers' backends would not count.
pub(crate) fn postgres_cpu_secs() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let is_postgres = |pid: u64| {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "postgres")
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| is_postgres(u64::from(pid)))
        .map(|pid| {
            let fields = stat_fields(pid);
            let field = |i: usize| fields.get(i).copied().unwrap_or(0);
            // The parent is field 4 (1 after the name); cutime and cstime 16 and 17.
            let postmaster = !is_postgres(field(1));
            let exited = if postmaster { field(13) + field(14) } else { 0 };
            (field(11) + field(12) + exited) as f64 / clock_ticks()
        })
        .sum()
}

/// The numeric fields of `/proc/<pid>/stat` after the command name (which may hold
/// spaces, so they start after the last ')'); the state letter reads as 0.
fn stat_fields(pid: u32) -> Vec<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or_default();
    rest.split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect()
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

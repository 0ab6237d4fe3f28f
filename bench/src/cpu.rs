//! CPU time by process, read from `/proc` (Linux only: elsewhere every reading is empty), for
//! the benchmark programs that print what a run cost (`brokers`, `sql_latency`).

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, 100 on every Linux build this
/// benchmark runs on).
const TICKS_PER_SEC: f64 = 100.0;

/// CPU seconds (user + system, of the process and of the children it reaped) by process name,
/// summed over every process of that name: one reading of `/proc`.
#[derive(Debug, Clone, Default)]
pub struct CpuReading(pub std::collections::HashMap<String, f64>);

impl CpuReading {
    /// Read every process's `/proc/<pid>/stat`, and this process's as `self`. Empty where
    /// `/proc` cannot be read.
    pub fn now() -> Self {
        let mut by_name = std::collections::HashMap::new();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Self(by_name);
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if let Some((comm, secs)) = std::fs::read_to_string(entry.path().join("stat"))
                .ok()
                .and_then(|stat| parse_stat(&stat))
            {
                *by_name.entry(comm).or_insert(0.0) += secs;
            }
        }
        if let Some((_, secs)) = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| parse_stat(&stat))
        {
            by_name.insert("self".to_owned(), secs);
        }
        Self(by_name)
    }

    /// Seconds used by processes named `name` since `before` (0 when none ran).
    pub fn since(&self, before: &Self, name: &str) -> f64 {
        let at = |r: &Self| r.0.get(name).copied().unwrap_or(0.0);
        (at(self) - at(before)).max(0.0)
    }
}

/// A process's name and CPU seconds (utime + stime + cutime + cstime) from its `stat` line.
fn parse_stat(stat: &str) -> Option<(String, f64)> {
    // The name is in parentheses and may hold spaces or parentheses: it ends at the last ')'.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    // After the name: state (field 3), ..., utime (14), stime (15), cutime (16), cstime (17).
    let fields: Vec<&str> = stat.get(close + 2..)?.split(' ').collect();
    let ticks = fields
        .get(11..15)?
        .iter()
        .map(|f| f.parse::<u64>().ok())
        .sum::<Option<u64>>()?;
    Some((comm, ticks as f64 / TICKS_PER_SEC))
}

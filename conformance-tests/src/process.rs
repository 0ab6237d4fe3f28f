//! Process state, for tests that freeze a server or a relay with `SIGSTOP`.

/// Whether every thread of process `pid` is stopped (state `T`, or `t` under a tracer), as
/// `/proc/<pid>/task/*/stat` shows. `false` when the process cannot be read (gone, or not
/// Linux).
///
/// `kill -STOP` returns once the stop is queued, not once it is done: the thread chosen to take
/// the signal may wait for a CPU while the process's other threads go on running (seen here, on
/// a loaded machine: a "frozen" NATS server acked a whole batch). A test that needs the process
/// frozen waits for this after sending the signal.
pub fn process_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    for task in tasks {
        let Ok(task) = task else { return false };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            return false;
        };
        // The command name is in parentheses and may contain spaces: the state follows it.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return false;
        }
        any = true;
    }
    any
}

/// After `kill -STOP`, wait until [`process_stopped`] says so; panics naming `what` if it has
/// not happened within 30 s (a guard: the stop normally shows within microseconds).
pub fn wait_until_stopped(pid: u32, what: &str) {
    let guard = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !process_stopped(pid) {
        assert!(std::time::Instant::now() < guard, "{what} did not stop");
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::{process_stopped, wait_until_stopped};

    #[test]
    fn tells_a_stopped_child_from_a_running_one() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        assert!(!process_stopped(pid));
        let status = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        wait_until_stopped(pid, "sleep");
        assert!(process_stopped(pid));
        let _ = child.kill();
        let _ = child.wait();
        assert!(!process_stopped(pid), "a reaped process is not stopped");
    }
}

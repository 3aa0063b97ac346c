//! The live progress lines `drain` and `replay` draw on a terminal, and the log writer that
//! keeps log lines from running into them: while a line is shown, every log line first
//! erases it (the next refresh draws it again below the log line).

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::metrics::TableLabel;
use super::Ops;

/// How often the progress line is drawn again: often enough to look live, the rate over
/// the last [`REDRAW`] steady enough to read.
const REDRAW: Duration = Duration::from_secs(1);

/// Draws `drain`'s line every [`REDRAW`] until `stop` or `done`: rows published, the rate over
/// the last second and the backlog left over `tables` (as of the last gauge refresh, less
/// what was published since).
pub(crate) async fn show(
    ops: &Ops,
    tables: &[String],
    published: &AtomicU64,
    stop: &CancellationToken,
    done: &CancellationToken,
) {
    let started = Instant::now();
    let mut last = (Instant::now(), 0u64);
    loop {
        tokio::select! {
            _ = done.cancelled() => break,
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(REDRAW) => {}
        }
        let published = published.load(Relaxed);
        let rate = (published - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), published);
        let backlog: i64 = tables
            .iter()
            .map(|t| {
                let label = TableLabel { table: t.clone() };
                ops.metrics.backlog.get_or_create(&label).get()
            })
            .sum();
        let since = published.saturating_sub(ops.published_at_backlog_read.load(Relaxed));
        let backlog = (backlog - since as i64).max(0);
        draw(&format!(
            "draining: {published} rows published in {:.0}s, {rate:.0} rows/s, backlog {backlog}",
            started.elapsed().as_secs_f64()
        ));
    }
    clear();
}

/// Draws `what`'s line every [`REDRAW`] until `done`, then once more: `done_rows` of
/// `total` rows (0: not counted yet), the rate over the last [`REDRAW`]. On a terminal in
/// place; otherwise (a pipe, a log collector) one line each.
pub async fn count_toward(
    what: &str,
    done_rows: &AtomicU64,
    total: &AtomicU64,
    done: &CancellationToken,
) {
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let started = Instant::now();
    let mut last = (Instant::now(), 0u64);
    let line = |last: &mut (Instant, u64)| {
        let rows = done_rows.load(Relaxed);
        let rate = rows.saturating_sub(last.1) as f64 / last.0.elapsed().as_secs_f64();
        *last = (Instant::now(), rows);
        let line = counted(what, rows, total.load(Relaxed), started.elapsed(), rate);
        if terminal {
            draw(&line);
        } else {
            eprintln!("{line}");
        }
    };
    loop {
        tokio::select! {
            _ = done.cancelled() => break,
            _ = tokio::time::sleep(REDRAW) => line(&mut last),
        }
    }
    if started.elapsed() >= REDRAW {
        line(&mut last);
    }
    clear();
}

/// One line of [`count_toward`].
fn counted(what: &str, rows: u64, total: u64, took: Duration, rate: f64) -> String {
    let of = match total {
        0 => String::new(),
        total => format!(" of {total} ({:.0}%)", rows as f64 * 100.0 / total as f64),
    };
    format!(
        "{what}: {rows}{of} rows in {:.0}s, {rate:.0} rows/s",
        took.as_secs_f64()
    )
}

/// Whether a progress line is on the terminal now.
static SHOWN: AtomicBool = AtomicBool::new(false);

/// Erases the current terminal line (carriage return, then ANSI "erase line").
const ERASE: &str = "\r\x1b[2K";

/// Draws `line` in place of the previous one, on stderr.
pub(crate) fn draw(line: &str) {
    let mut err = std::io::stderr().lock();
    let _ = write!(err, "{ERASE}{line}");
    let _ = err.flush();
    SHOWN.store(true, Relaxed);
}

/// Erases the line, for good or until the next [`draw`].
pub(crate) fn clear() {
    if SHOWN.swap(false, Relaxed) {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "{ERASE}");
        let _ = err.flush();
    }
}

/// The log writer: stderr, erasing a shown progress line before each log line.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = LossyStderr;

    fn make_writer(&'a self) -> Self::Writer {
        clear();
        LossyStderr(std::io::stderr())
    }
}

/// Stderr that drops what it cannot write. A log line that cannot be written (stderr
/// closed: a pipe whose reader exited, a log collector that went away) is lost, and
/// nothing else: tracing-subscriber reports a failed write with `eprintln!`, which panics
/// when stderr is broken, and a panic in the signal thread or a worker would leave the
/// relay deaf to SIGTERM or one worker short.
#[derive(Debug)]
pub struct LossyStderr(std::io::Stderr);

impl Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = self.0.write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = self.0.flush();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counted_line_says_how_many_of_how_many_and_how_fast() {
        let took = Duration::from_secs(3);
        assert_eq!(
            counted("replaying", 2_500, 10_000, took, 812.4),
            "replaying: 2500 of 10000 (25%) rows in 3s, 812 rows/s"
        );
        assert_eq!(
            counted("replaying", 0, 0, took, 0.0),
            "replaying: 0 rows in 3s, 0 rows/s"
        );
    }
}

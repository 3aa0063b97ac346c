//! The one backoff the relay uses, everywhere it waits before trying again: start-up
//! (PostgreSQL or the broker not reachable yet), a worker after a failed batch, the
//! circuit breaker's prober, LISTEN reconnects, and a failed row's next attempt.
//!
//! Capped exponential backoff with *full jitter*: the n-th wait (n from 0) is uniform in
//! `[0, min(cap, base * 2^n)]`. Jitter spreads the retries of many workers, relays and rows
//! so they do not hit a recovering dependency in lockstep (AWS Architecture Blog,
//! "Exponential Backoff And Jitter": full jitter does the least total work).

use std::time::Duration;

/// The ceiling of the `attempt`-th wait (from 0): `min(cap, base * 2^attempt)`.
pub(crate) fn ceiling(base: Duration, cap: Duration, attempt: u32) -> Duration {
    base.saturating_mul(1u32 << attempt.min(30)).min(cap)
}

/// A random wait in `[0, ceiling(base, cap, attempt)]`.
pub(crate) fn full_jitter(base: Duration, cap: Duration, attempt: u32) -> Duration {
    let top = ceiling(base, cap, attempt).as_micros() as u64;
    Duration::from_micros(rand::random_range(0..=top))
}

/// Successive waits of one retry loop: [`full_jitter`] with a floor, so a loop that keeps
/// failing never spins.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

/// The shortest pause a [`Backoff`] returns.
pub(crate) const MIN_PAUSE: Duration = Duration::from_millis(10);

/// The first pause before trying a dependency again (start-up, LISTEN): one that is
/// starting alongside the relay is usually up within it.
pub(crate) const RECONNECT_FIRST: Duration = Duration::from_millis(250);
/// The longest pause between tries: a dependency that comes back is found within it,
/// without hammering one that stays down.
pub(crate) const RECONNECT_MAX: Duration = Duration::from_secs(10);

impl Backoff {
    /// The pauses between attempts to reach a dependency: [`RECONNECT_FIRST`] doubling to
    /// [`RECONNECT_MAX`].
    pub(crate) fn reconnect() -> Backoff {
        Backoff::new(RECONNECT_FIRST, RECONNECT_MAX)
    }

    pub(crate) fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    /// The next wait: random in `[MIN_PAUSE, min(cap, base * 2^attempt)]`.
    pub(crate) fn next_pause(&mut self) -> Duration {
        let pause = full_jitter(self.base, self.cap, self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        pause.max(MIN_PAUSE)
    }

    /// The ceiling the next pause is drawn under.
    #[cfg(test)]
    pub(crate) fn next_ceiling(&self) -> Duration {
        ceiling(self.base, self.cap, self.attempt)
    }

    /// Back to the first, shortest wait.
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_ceiling_doubles_from_base_up_to_the_cap() {
        let (base, cap) = (100 * MS, 2_000 * MS);
        let ceilings: Vec<u128> = (0..8).map(|n| ceiling(base, cap, n).as_millis()).collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        assert_eq!(ceiling(base, cap, u32::MAX), cap, "no overflow");
    }

    #[test]
    fn waits_spread_over_the_whole_jitter_range() {
        // 2,000 draws under a 1 s ceiling: every tenth of the range is hit, none exceeds it.
        let mut tenths = [0u32; 10];
        for _ in 0..2_000 {
            let wait = full_jitter(250 * MS, 10_000 * MS, 2);
            assert!(wait <= 1_000 * MS, "{wait:?}");
            tenths[(wait.as_millis().min(999) / 100) as usize] += 1;
        }
        assert!(tenths.iter().all(|&n| n > 100), "uneven spread: {tenths:?}");
    }

    #[test]
    fn backoff_grows_caps_and_resets() {
        let mut b = Backoff::new(100 * MS, 2_000 * MS);
        let mut seen_max = Duration::ZERO;
        for n in 0..20 {
            let ceiling = b.next_ceiling();
            assert_eq!(ceiling, super::ceiling(100 * MS, 2_000 * MS, n));
            let pause = b.next_pause();
            assert!(
                pause >= MIN_PAUSE && pause <= ceiling.max(MIN_PAUSE),
                "{pause:?}"
            );
            seen_max = seen_max.max(pause);
        }
        assert!(
            seen_max > 1_000 * MS,
            "never grew past half the cap: {seen_max:?}"
        );
        b.reset();
        assert_eq!(b.next_ceiling(), 100 * MS);
    }
}

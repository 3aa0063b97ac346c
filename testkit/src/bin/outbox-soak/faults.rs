//! The faults: what can go wrong around a relay in production, fired one at a time at
//! seeded moments, each held for a seeded while and then healed.
//!
//! `--faults N` over `--minutes M` gives every fault a slot of M/N; it fires at a random
//! point in the first third of its slot and is healed within 60% of the slot, so faults
//! never overlap and the relays get a moment between them (not always enough to catch
//! up: that is the point).

use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use testkit::{Fault as Link, Proxy};

use crate::world::{World, STREAM};

/// The kinds, with their weight in the random choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    RelayKill,
    RelayTerm,
    RelayStop,
    PgFreeze,
    PgDrop,
    PgLatency,
    PgCrash,
    BouncerKill,
    NatsKill,
    NatsStepDown,
    NatsFreeze,
    NatsDrop,
    NatsLatency,
}

const KINDS: [(Kind, u32); 13] = [
    (Kind::RelayKill, 3),
    (Kind::RelayTerm, 2),
    (Kind::RelayStop, 2),
    (Kind::PgFreeze, 2),
    (Kind::PgDrop, 2),
    (Kind::PgLatency, 1),
    (Kind::PgCrash, 1),
    (Kind::BouncerKill, 1),
    (Kind::NatsKill, 2),
    (Kind::NatsStepDown, 1),
    (Kind::NatsFreeze, 2),
    (Kind::NatsDrop, 1),
    (Kind::NatsLatency, 1),
];

/// Latency added by the latency faults, each way.
const LATENCY: Duration = Duration::from_millis(200);

impl Kind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::RelayKill => "relay: kill -9, restarted",
            Kind::RelayTerm => "relay: SIGTERM (drain, exit), restarted",
            Kind::RelayStop => "relay: SIGSTOP 1-8 s, then SIGCONT",
            Kind::PgFreeze => "relay's PostgreSQL link frozen 2-20 s",
            Kind::PgDrop => "relay's PostgreSQL connections dropped",
            Kind::PgLatency => "relay's PostgreSQL link +200 ms for 3-10 s",
            Kind::PgCrash => "PostgreSQL crash (immediate stop), restarted after 0.5-3 s",
            Kind::BouncerKill => "PgBouncer kill -9, restarted after 0.5-2 s",
            Kind::NatsKill => "NATS server kill -9 (leader half the time), restarted after 2-8 s",
            Kind::NatsStepDown => "NATS stream leader steps down",
            Kind::NatsFreeze => "a NATS server's links frozen 2-15 s",
            Kind::NatsDrop => "a NATS server's connections dropped",
            Kind::NatsLatency => "a NATS server's links +200 ms for 3-10 s",
        }
    }

    /// The range of the hold time, in milliseconds (`None`: the fault is instant).
    fn hold(self) -> Option<(u64, u64)> {
        match self {
            Kind::RelayStop => Some((1_000, 8_000)),
            Kind::PgFreeze => Some((2_000, 20_000)),
            Kind::PgLatency | Kind::NatsLatency => Some((3_000, 10_000)),
            Kind::PgCrash => Some((500, 3_000)),
            Kind::BouncerKill => Some((500, 2_000)),
            Kind::NatsKill => Some((2_000, 8_000)),
            Kind::NatsFreeze => Some((2_000, 15_000)),
            Kind::RelayKill
            | Kind::RelayTerm
            | Kind::PgDrop
            | Kind::NatsStepDown
            | Kind::NatsDrop => None,
        }
    }
}

/// One fault as it fired.
#[derive(Debug, Clone)]
pub(crate) struct Fired {
    pub(crate) kind: Kind,
    /// Relay or NATS server index, where the fault has one.
    pub(crate) target: Option<usize>,
    pub(crate) start: SystemTime,
    pub(crate) end: SystemTime,
    /// What the fault saw: a SIGTERM'd relay's exit code, a NATS victim's role.
    pub(crate) note: String,
}

pub(crate) struct Schedule {
    rng: StdRng,
    pub(crate) slot: Duration,
    pub(crate) fired: Vec<Fired>,
}

impl Schedule {
    pub(crate) fn new(seed: u64, minutes: f64, faults: u32) -> Schedule {
        Schedule {
            rng: StdRng::seed_from_u64(seed),
            slot: Duration::from_secs_f64(minutes * 60.0 / faults.max(1) as f64),
            fired: Vec::new(),
        }
    }

    fn pick(&mut self) -> Kind {
        let total: u32 = KINDS.iter().map(|(_, w)| w).sum();
        let mut n = self.rng.random_range(0..total);
        for (kind, weight) in KINDS {
            if n < weight {
                return kind;
            }
            n -= weight;
        }
        unreachable!()
    }

    /// Runs fault `index`'s slot (starting at `slot_start`): waits for its moment, fires,
    /// holds, heals, and returns at the slot's end.
    pub(crate) async fn run_slot(&mut self, world: &mut World, slot_start: Instant) -> Result<()> {
        let kind = self.pick();
        let offset = self.slot.mul_f64(self.rng.random_range(0.0..0.33));
        let hold = kind.hold().map(|(lo, hi)| {
            Duration::from_millis(self.rng.random_range(lo..=hi)).min(self.slot.mul_f64(0.6))
        });
        let relay = self.rng.random_range(0..world.relays.len());
        let server = self.rng.random_range(0..3);
        let leader_victim = self.rng.random_bool(0.5);
        idle_until(world, slot_start + offset).await?;
        let start = SystemTime::now();
        let (target, note) = fire(world, kind, relay, server, leader_victim, hold).await?;
        self.fired.push(Fired {
            kind,
            target,
            start,
            end: SystemTime::now(),
            note,
        });
        idle_until(world, slot_start + self.slot).await
    }
}

/// Sleeps until `when`, restarting any relay that exits on its own meanwhile.
pub(crate) async fn idle_until(world: &mut World, when: Instant) -> Result<()> {
    loop {
        tokio::task::block_in_place(|| world.relays.reap())?;
        let now = Instant::now();
        if now >= when {
            return Ok(());
        }
        tokio::time::sleep((when - now).min(Duration::from_millis(100))).await;
    }
}

async fn held(world: &mut World, hold: Option<Duration>) -> Result<()> {
    idle_until(world, Instant::now() + hold.unwrap_or_default()).await
}

/// Applies `kind`, holds it, heals it. Returns the target and a note.
async fn fire(
    world: &mut World,
    kind: Kind,
    relay: usize,
    server: usize,
    leader_victim: bool,
    hold: Option<Duration>,
) -> Result<(Option<usize>, String)> {
    let note = String::new();
    match kind {
        Kind::RelayKill => {
            tokio::task::block_in_place(|| world.relays.kill(relay))?;
            Ok((Some(relay), note))
        }
        Kind::RelayTerm => {
            let code = tokio::task::block_in_place(|| world.relays.terminate(relay))?;
            let note = match code {
                Some(code) => format!("exit {code}"),
                None => "killed after the drain deadline".to_owned(),
            };
            Ok((Some(relay), note))
        }
        Kind::RelayStop => {
            world.relays.pause(relay);
            held(world, hold).await?;
            world.relays.resume(relay);
            Ok((Some(relay), note))
        }
        Kind::PgFreeze | Kind::PgLatency | Kind::NatsFreeze | Kind::NatsLatency => {
            let link = match kind {
                Kind::PgFreeze | Kind::NatsFreeze => Link::Freeze,
                _ => Link::Latency(LATENCY),
            };
            // A relay's own database link, or a NATS server's link shared by the relays.
            let (proxies, i): (fn(&World) -> &[Proxy], usize) = match kind {
                Kind::PgFreeze | Kind::PgLatency => (|w| &w.pg_proxies, relay),
                _ => (|w| &w.nats_proxies, server),
            };
            proxies(world)[i].set(link);
            held(world, hold).await?;
            proxies(world)[i].set(Link::None);
            Ok((Some(i), note))
        }
        Kind::PgDrop => {
            world.pg_proxies[relay].drop_connections();
            Ok((Some(relay), note))
        }
        Kind::PgCrash => {
            tokio::task::block_in_place(|| world.pg.stop_immediate());
            held(world, hold).await?;
            tokio::task::block_in_place(|| world.pg.restart())?;
            Ok((None, note))
        }
        Kind::BouncerKill => {
            world.bouncer.kill();
            held(world, hold).await?;
            tokio::task::block_in_place(|| world.bouncer.start_again())?;
            Ok((None, note))
        }
        Kind::NatsKill => {
            // One server down at a time, and only once the stream's replicas are current:
            // two of three must stay to keep the stream's quorum.
            if world.nats.alive().len() < 3
                || world.nats.wait_for_stream_current(STREAM).await.is_err()
            {
                tokio::task::block_in_place(|| world.relays.kill(relay))?;
                return Ok((
                    Some(relay),
                    "NATS not settled: a relay kill -9 instead".into(),
                ));
            }
            let leader = world.nats.stream_leader(STREAM).await.ok();
            let victim = match leader {
                Some(l) if leader_victim => l,
                Some(l) => (l + 1 + server % 2) % 3,
                None => server,
            };
            let role = if Some(victim) == leader {
                "stream leader"
            } else {
                "follower"
            };
            tokio::task::block_in_place(|| world.nats.kill(victim));
            held(world, hold).await?;
            tokio::task::block_in_place(|| world.nats.restart(victim))?;
            Ok((Some(victim), role.into()))
        }
        Kind::NatsStepDown => {
            let note = match world.nats.step_down(STREAM).await {
                Ok(new) => format!("new leader n{new}"),
                Err(e) => format!("step-down failed: {e}"),
            };
            Ok((None, note))
        }
        Kind::NatsDrop => {
            world.nats_proxies[server].drop_connections();
            Ok((Some(server), note))
        }
    }
}

//! `check` against NATS: JetStream on, a stream for every subject, each stream's duplicate
//! window and durability (replicas, storage, the server's sync interval).
//!
//! What the relay can see of the sync interval through its client connection:
//! nats-server before 2.10 syncs every 2 minutes and cannot be configured otherwise (its
//! version is in the connection's INFO); 2.10 and later report `sync_interval` /
//! `sync_always` only in `/varz` (the monitoring port, which the relay is not given) or
//! to a system-account user through `$SYS.REQ.SERVER.PING.VARZ`, which `check` asks.

use std::collections::BTreeSet;
use std::time::Duration;

use super::durability::{judge_stream, StreamSettings, SyncPolicy, NATS_DEFAULT_SYNC};
use super::{Level, Report};
use crate::sink::nats::{check_subject, NatsSink};

/// JetStream de-duplicates re-sent messages only inside this window; shorter windows let
/// duplicates through after a crash between publish and commit.
const MIN_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// How long `check` waits for a system-account answer to `$SYS.REQ.SERVER.PING.VARZ`.
const VARZ_LIMIT: Duration = Duration::from_secs(1);

/// JetStream on, every subject of every table stored by a stream, and each such stream's
/// duplicate window and durability (once a stream, however many tables it serves).
pub(super) async fn check_streams(
    sink: &NatsSink,
    subjects: &[(String, BTreeSet<String>)],
    out: &mut Report,
) {
    let info = sink.server_info();
    if !check_jetstream(&info, out) {
        return;
    }
    let mut sync: Option<SyncPolicy> = None;
    let mut streams_judged = BTreeSet::new();
    for (table, set) in subjects {
        let streams_seen = match_subjects(sink.jetstream(), table, set, out).await;
        for name in streams_seen {
            // Two tables' subjects in one stream: its settings once.
            if streams_judged.insert(name.clone()) {
                check_stream(sink, &info.version, &name, &mut sync, out).await;
            }
        }
    }
}

/// Whether the server has JetStream on; either way, said in `out`.
fn check_jetstream(info: &async_nats::ServerInfo, out: &mut Report) -> bool {
    if !info.jetstream {
        out.push(
            Level::Fail,
            "jetstream",
            format!(
                "server {} has JetStream disabled: start it with -js (or jetstream {{}} in its config)",
                info.version
            ),
        );
        return false;
    }
    out.push(
        Level::Ok,
        "jetstream",
        format!("enabled (nats-server {})", info.version),
    );
    true
}

/// The streams that store `table`'s subjects; a subject no stream captures (or not a valid
/// subject) is a failure in `out`.
async fn match_subjects(
    js: &async_nats::jetstream::Context,
    table: &str,
    set: &BTreeSet<String>,
    out: &mut Report,
) -> BTreeSet<String> {
    if set.is_empty() {
        out.push(
            Level::Ok,
            format!("table {table}"),
            "subjects depend on row data and no row is pending; nothing to match to a \
             stream yet (nor its durability to check)",
        );
    }
    let mut streams_seen = BTreeSet::new();
    for subject in set {
        if let Err(e) = check_subject(subject) {
            out.push(Level::Fail, format!("subject {subject:?}"), e);
            continue;
        }
        match js.stream_by_subject(subject.clone()).await {
            Ok(stream) => {
                out.push(
                    Level::Ok,
                    format!("subject {subject}"),
                    format!("stored by stream {stream}"),
                );
                streams_seen.insert(stream);
            }
            Err(_) => out.push(
                Level::Fail,
                format!("subject {subject}"),
                "no JetStream stream captures it: create one, e.g. \
                 `nats stream add OUTBOX --subjects '<subject or wildcard>' --dupe-window 2m \
                 --storage file --replicas 3`",
            ),
        }
    }
    streams_seen
}

/// Stream `name`'s duplicate window and durability. The server's sync policy is asked the
/// first time a stream needs it and kept in `sync` for the next.
async fn check_stream(
    sink: &NatsSink,
    version: &str,
    name: &str,
    sync: &mut Option<SyncPolicy>,
    out: &mut Report,
) {
    let subject = format!("stream {name}");
    let config = match sink.jetstream().get_stream(name).await {
        Ok(mut stream) => match stream.info().await {
            Ok(info) => info.config.clone(),
            Err(e) => {
                out.unverified(subject, format!("its settings could not be read: {e}"));
                return;
            }
        },
        Err(e) => {
            out.unverified(subject, format!("its settings could not be read: {e}"));
            return;
        }
    };
    if config.duplicate_window < MIN_DUPLICATE_WINDOW {
        out.push(
            Level::Warn,
            subject.clone(),
            format!(
                "duplicate window is {:?}; under 2m a re-send after a crash may not \
                 be de-duplicated: raise it (--dupe-window 2m)",
                config.duplicate_window
            ),
        );
    } else {
        out.push(
            Level::Ok,
            subject.clone(),
            format!("duplicate window {:?}", config.duplicate_window),
        );
    }
    // The connected server's; asked once, and only when there is a stream.
    let policy = match sync {
        Some(policy) => policy.clone(),
        None => sync.insert(server_sync(sink, version).await).clone(),
    };
    let settings = StreamSettings {
        name: name.to_owned(),
        // The server reports 1 for a stream created without a replica count.
        replicas: config.num_replicas.max(1),
        memory: config.storage == async_nats::jetstream::stream::StorageType::Memory,
        sync: policy,
    };
    out.durability(subject, judge_stream(&settings));
}

/// How the server syncs its stream files, as far as this connection can tell.
async fn server_sync(sink: &NatsSink, version: &str) -> SyncPolicy {
    if before_2_10(version) {
        return SyncPolicy::Every {
            interval: NATS_DEFAULT_SYNC,
            how: format!(
                "fixed in nats-server {version}; `sync_interval` is configurable from 2.10"
            ),
        };
    }
    match varz_sync(sink).await {
        Some(policy) => policy,
        None => SyncPolicy::Unseen {
            why: format!(
                "nats-server {version} reports it only to a system-account user or on its \
                 monitoring port: see /varz jetstream.config.sync_interval"
            ),
        },
    }
}

/// `$SYS.REQ.SERVER.PING.VARZ`'s `jetstream.config`, when this connection is a
/// system-account user (anyone else gets no responders or no answer in time).
async fn varz_sync(sink: &NatsSink) -> Option<SyncPolicy> {
    let client = sink.jetstream().client();
    let reply = tokio::time::timeout(
        VARZ_LIMIT,
        client.request("$SYS.REQ.SERVER.PING.VARZ", "".into()),
    )
    .await
    .ok()?
    .ok()?;
    let varz: serde_json::Value = serde_json::from_slice(&reply.payload).ok()?;
    sync_from_varz(&varz)
}

/// The sync policy in a `$SYS.REQ.SERVER.PING.VARZ` answer (`{"data": {"jetstream":
/// {"config": {"sync_interval": <ns>, "sync_always": <bool>}}}}`; nats-server 2.10+ leaves
/// out a field at its default).
fn sync_from_varz(varz: &serde_json::Value) -> Option<SyncPolicy> {
    let config = varz.get("data")?.get("jetstream")?.get("config")?;
    if config.get("sync_always").and_then(|v| v.as_bool()) == Some(true) {
        return Some(SyncPolicy::Always);
    }
    // Go's time.Duration in nanoseconds; absent: the default.
    let interval = config
        .get("sync_interval")
        .and_then(|v| v.as_u64())
        .map(Duration::from_nanos)
        .unwrap_or(NATS_DEFAULT_SYNC);
    Some(SyncPolicy::Every {
        interval,
        how: "the server's /varz, asked as a system-account user".into(),
    })
}

/// Whether `version` (`2.9.10`, `v2.10.0-beta`) is before 2.10, where `sync_interval` came.
fn before_2_10(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) < (2, 10),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varz_says_always_an_interval_or_nothing_for_the_default() {
        let varz = |config: serde_json::Value| {
            sync_from_varz(&serde_json::json!({"data": {"jetstream": {"config": config}}}))
        };
        assert_eq!(
            varz(serde_json::json!({"sync_always": true})),
            Some(SyncPolicy::Always)
        );
        let every = |p: Option<SyncPolicy>| match p {
            Some(SyncPolicy::Every { interval, .. }) => interval,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            every(varz(
                serde_json::json!({"sync_interval": 10_000_000_000u64})
            )),
            Duration::from_secs(10)
        );
        assert_eq!(
            every(varz(serde_json::json!({"max_memory": 1}))),
            NATS_DEFAULT_SYNC
        );
        assert_eq!(
            sync_from_varz(&serde_json::json!({"error": "denied"})),
            None
        );
    }

    #[test]
    fn sync_interval_is_fixed_before_nats_server_2_10() {
        assert!(before_2_10("2.9.10"));
        assert!(before_2_10("v2.9.25"));
        assert!(!before_2_10("2.10.0"));
        assert!(!before_2_10("2.12.1-RC.1"));
        assert!(!before_2_10("unknown"));
    }
}

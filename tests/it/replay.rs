//! `outbox-relay replay` (mark mode): rows kept as published become pending again and the
//! relay publishes exactly those again, each ahead of its key's later pending rows.
//! What the relay sends is counted by a core NATS subscriber: the stream would drop the
//! replayed messages as duplicates of their first publish (same `Nats-Msg-Id`).

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;

fn id_of(msg_id: &str) -> i64 {
    msg_id.rsplit(':').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_publishes_exactly_the_chosen_rows_again_in_key_order_ahead_of_later_rows() {
    let env = Env::new(relay().on_publish("mark").batch_size(50)).await;
    let client = env.client().await;
    seed(&client, 300, 10, 0).await;
    // A running relay: its claim floor has moved past the rows to replay, so it finds them
    // only as rows with a retry history (next_attempt_at set), as the claim promises.
    let mut relay = env.spawn_run();
    let unpublished = "SELECT count(*) FROM public.outbox WHERE published_at IS NULL";
    wait_until("the first publish", Duration::from_secs(30), async || {
        count(&client, unpublished).await == 0
    })
    .await;
    // The first 100 rows are from three hours ago; one of them is dead (left alone; a key
    // of its own, or it would hold its key's later rows back).
    client
        .batch_execute(
            "UPDATE public.outbox SET created_at = now() - interval '3 hours' WHERE id <= 100;
             UPDATE public.outbox SET published_at = NULL, dead_at = now(), attempts = 10,
                                      key = 'solo' WHERE id = 50",
        )
        .await
        .unwrap();
    let sent = watch_sends(&env.nats).await;

    let out = env.relay(&["replay", "--since", "4h", "--until", "2h", "--dry-run"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("would replay 99 published rows"),
        "{}",
        text(&out)
    );
    assert_eq!(
        count(&client, unpublished).await,
        1,
        "a dry run changes nothing"
    );

    let out = env.relay(&["replay", "--since", "4h", "--until", "2h"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("replayed 99 published rows"),
        "{}",
        text(&out)
    );
    // Later rows of the same keys, committed after the replay, wait for the replayed ones.
    let later: Vec<i64> = column(
        &client,
        "INSERT INTO public.outbox (topic, key, payload)
             SELECT 'events.0', 'k' || n, 'later' FROM generate_series(0, 9) n RETURNING id",
        &[],
    )
    .await;
    wait_until(
        "the running relay to publish them",
        Duration::from_secs(30),
        async || count(&client, unpublished).await == 1,
    )
    .await;
    wait_until(
        "the subscriber to see every send",
        Duration::from_secs(10),
        async || sent.lock().unwrap().len() >= 109,
    )
    .await;
    terminate_cleanly(&mut relay);

    let sent: Vec<i64> = sent.lock().unwrap().iter().map(|m| id_of(m)).collect();
    let mut replayed: Vec<i64> = sent
        .iter()
        .copied()
        .filter(|id| !later.contains(id))
        .collect();
    replayed.sort_unstable();
    let expected: Vec<i64> = (1..=100).filter(|id| *id != 50).collect();
    assert_eq!(
        replayed, expected,
        "exactly the chosen rows, once each, the dead one not"
    );
    // Key order: per key, the replayed ids in id order, then the later row.
    let keys: HashMap<i64, String> = client
        .query("SELECT id, key FROM public.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for id in &sent {
        by_key.entry(&keys[id]).or_default().push(*id);
    }
    for (key, ids) in &by_key {
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{key}: {ids:?}");
    }
    assert_eq!(sent.len(), 109, "nothing else was sent");
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_by_id_warns_about_rows_not_published_is_refused_in_delete_mode_and_since_needs_created_at(
) {
    let env = Env::new(relay().on_publish("mark")).await;
    let client = env.client().await;
    seed(&client, 20, 2, 0).await;
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    client
        .batch_execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('events.0', 'k0', 'x')",
        )
        .await
        .unwrap();
    let out = env.relay(&["replay", "--id", "3", "4", "21", "99"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("replayed 2 published rows"),
        "{}",
        text(&out)
    );
    assert!(
        text(&out).contains("left as they are: 21, 99"),
        "{}",
        text(&out)
    );

    env.write_config(&relay().on_publish("delete"));
    let out = env.relay(&["replay", "--id", "3"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("on_publish = \"mark\""),
        "{}",
        text(&out)
    );
    // A table without a creation-time column takes --id only.
    env.write_config(&relay().on_publish("mark"));
    client
        .batch_execute("ALTER TABLE public.outbox DROP COLUMN created_at")
        .await
        .unwrap();
    let out = env.relay(&["replay", "--since", "1h"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("has no creation-time column to select by: use --id"),
        "{}",
        text(&out)
    );
    let out = env.relay(&["replay", "--id", "5"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("replayed 1 published rows"),
        "{}",
        text(&out)
    );
}

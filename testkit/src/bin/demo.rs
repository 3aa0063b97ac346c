//! End-to-end demo on throwaway services: PostgreSQL + nats-server (or a Kafka-protocol
//! broker), 20,000 outbox rows over 200 keys plus NULL-key rows plus one transaction that
//! commits after later ids, `outbox-relay migrate`, `outbox-relay drain`, then an
//! independent consumer checks what arrived. Run it through `scripts/demo`.
//!
//! Flags and their defaults: `demo --help` ([`Args`]).

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Parser;
use testkit::{KafkaBroker, NatsServer, Postgres};

const TOPICS: [&str; 5] = [
    "orders.0",
    "orders.1",
    "orders.2",
    "orders.3",
    "orders.late",
];

/// End-to-end demo on a throwaway PostgreSQL and nats-server (or tansu): seeds the outbox,
/// runs `outbox-relay migrate` and `drain`, and checks delivery with an independent
/// consumer. Run it through `scripts/demo`.
#[derive(Parser)]
#[command(name = "demo", args_override_self = true)]
struct Args {
    /// The outbox-relay binary to run.
    #[arg(value_name = "PATH-TO-outbox-relay")]
    relay: String,
    /// Rows to seed (200 keys, every 50th row with a NULL key), besides the one late row.
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    rows: i64,
    /// `relay.on_publish = "mark"`: published rows stay in the table (default: "delete").
    #[arg(long)]
    mark: bool,
    /// A Kafka-protocol broker (tansu) instead of nats-server.
    #[arg(long)]
    kafka: bool,
}

enum Broker {
    Nats(NatsServer),
    Kafka(KafkaBroker),
}

/// One message as the consumer saw it.
struct Received {
    /// `Nats-Msg-Id` or the `outbox-id` header.
    id: String,
    key: Option<String>,
    /// Where order is observable: the whole stream (NATS), or a topic (Kafka).
    order_scope: String,
    shown: String,
}

impl Broker {
    fn sink_config(&self) -> String {
        match self {
            Broker::Nats(n) => format!(
                "[sink]\nkind = \"nats\"\n\n[sink.nats]\nurl = \"{}\"\n",
                n.url()
            ),
            Broker::Kafka(k) => format!(
                "[sink]\nkind = \"kafka\"\n\n[sink.kafka]\nbrokers = \"{}\"\n",
                k.bootstrap()
            ),
        }
    }

    /// Everything the broker holds, and how per-key order is judged.
    async fn read(&self) -> Result<(Vec<Received>, &'static str)> {
        match self {
            Broker::Nats(n) => Ok((
                n.read_stream("OUTBOX")
                    .await?
                    .into_iter()
                    .map(|m| Received {
                        id: m.header("Nats-Msg-Id").unwrap_or_default().to_owned(),
                        key: m.header("key").map(str::to_owned),
                        order_scope: String::new(),
                        shown: format!(
                            "subject={} Nats-Msg-Id={} payload={}",
                            m.subject,
                            m.header("Nats-Msg-Id").unwrap_or(""),
                            String::from_utf8_lossy(&m.payload)
                        ),
                    })
                    .collect(),
                "in the stream",
            )),
            Broker::Kafka(k) => {
                let mut records =
                    testkit::kafka_read_all(&k.bootstrap(), &TOPICS, Duration::from_secs(3))?;
                records.sort_by_key(|r| (r.topic.clone(), r.partition, r.offset));
                Ok((
                    records
                        .into_iter()
                        .map(|r| Received {
                            id: r.header("outbox-id").unwrap_or_default().to_owned(),
                            shown: format!(
                                "topic={} partition={} key={} outbox-id={} payload={}",
                                r.topic,
                                r.partition,
                                r.key.as_deref().unwrap_or("-"),
                                r.header("outbox-id").unwrap_or(""),
                                String::from_utf8_lossy(r.payload.as_deref().unwrap_or_default())
                            ),
                            key: r.key,
                            order_scope: format!("{}/{}", r.topic, r.partition),
                        })
                        .collect(),
                    "within their topic partition",
                ))
            }
        }
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let Args {
        relay,
        rows,
        mark,
        kafka,
    } = Args::parse();
    let on_publish = if mark { "mark" } else { "delete" };

    let pg = Postgres::start()?;
    let broker = if kafka {
        step("Starting a throwaway PostgreSQL and Kafka-protocol broker (tansu) on free 127.0.0.1 ports");
        let broker = KafkaBroker::start()?;
        for topic in TOPICS {
            broker.create_topic(topic, 3)?;
        }
        println!(
            "    kafka     {} (topics orders.0 to orders.3 and orders.late, 3 partitions each)",
            broker.bootstrap()
        );
        Broker::Kafka(broker)
    } else {
        step("Starting a throwaway PostgreSQL and nats-server -js on free 127.0.0.1 ports");
        let nats = NatsServer::start()?;
        nats.create_stream("OUTBOX", &["orders.>"]).await?;
        println!(
            "    nats      {} (stream OUTBOX on orders.>, 2m duplicate window)",
            nats.url()
        );
        Broker::Nats(nats)
    };
    let db_url = pg.create_database("app").await?;
    println!("    postgres  {db_url}");

    let dir = std::env::temp_dir().join(format!("outbox-relay-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"{db_url}\"\n\n[relay]\nworkers = 4\nbatch_size = 500\n\
             on_publish = \"{on_publish}\"\n\n{}\n\
             [[tables]]\nname = \"public.outbox\"\ntopic = \"{{topic}}\"\n",
            broker.sink_config()
        ),
    )?;
    println!("    config    {}", config.display());

    step("outbox-relay migrate (twice: the second run changes nothing)");
    for _ in 0..2 {
        run(&relay, &["migrate", "--config", config.to_str().unwrap()])?;
    }

    step(&format!(
        "Seeding {rows} rows over 200 keys, every 50th with a NULL key, and one late transaction"
    ));
    let client = pg.connect("app").await?;
    let mut late_client = pg.connect("app").await?;
    let late = late_client.transaction().await?;
    let late_id: i64 = late
        .query_one(
            "INSERT INTO outbox (topic, key, payload, headers)
             VALUES ('orders.late', 'k-late', 'committed after later ids', '{\"source\":\"demo\"}')
             RETURNING id",
            &[],
        )
        .await?
        .get(0);
    client
        .execute(
            "INSERT INTO outbox (topic, key, payload, headers)
             SELECT 'orders.' || (n % 4), key,
                    convert_to(json_build_object('order', n)::text, 'UTF8'),
                    -- the key travels as a header too, so the consumer can check its order
                    jsonb_strip_nulls(jsonb_build_object('source', 'demo', 'key', key))
             FROM (SELECT n, CASE WHEN n % 50 = 0 THEN NULL ELSE 'k' || (n % 200) END AS key
                   FROM generate_series(1, $1::bigint) n) s
             ORDER BY n",
            &[&rows],
        )
        .await?;
    println!("    late row id {late_id} is still uncommitted; {rows} later rows are committed");

    step("outbox-relay drain (the late transaction commits while it runs)");
    let drain = Command::new(&relay)
        .args(["drain", "--config", config.to_str().unwrap()])
        .stdout(Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    loop {
        let left: i64 = client.query_one(PENDING, &[]).await?.get(0);
        if left < rows / 2 || started.elapsed() > Duration::from_secs(30) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    late.commit().await?;
    let out = drain.wait_with_output()?;
    print!("    {}", String::from_utf8_lossy(&out.stdout));
    if out.status.code() != Some(0) {
        bail!("drain exited with {:?}", out.status.code());
    }

    step("Reading everything back with an independent consumer");
    let (received, per_key_order) = broker.read().await?;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut by_key: BTreeMap<(String, String), Vec<i64>> = BTreeMap::new();
    for m in &received {
        let count = seen.entry(m.id.clone()).or_default();
        *count += 1;
        if let (1, Some(key)) = (*count, &m.key) {
            let n: i64 = m.id.rsplit(':').next().unwrap().parse()?;
            by_key
                .entry((m.order_scope.clone(), key.clone()))
                .or_default()
                .push(n);
        }
    }
    let left: i64 = client.query_one(PENDING, &[]).await?.get(0);
    let kept: i64 = client
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    let expected = rows as usize + 1;
    let duplicates: usize = seen.values().map(|c| c - 1).sum();
    let out_of_order = by_key
        .values()
        .filter(|ids| ids.windows(2).any(|w| w[0] >= w[1]))
        .count();
    println!("    messages received       {}", received.len());
    println!(
        "    distinct message ids    {} (expected {expected})",
        seen.len()
    );
    println!("    duplicates              {duplicates}");
    println!(
        "    keys out of id order    {out_of_order} (checked {per_key_order}, {} key groups)",
        by_key.len()
    );
    println!(
        "    late row delivered      {}",
        seen.contains_key(&format!("public.outbox:{late_id}"))
    );
    println!(
        "    rows left unpublished   {left} (kept in the table: {kept}, on_publish = {on_publish})"
    );
    if let Some(first) = received.first() {
        println!("    first message           {}", first.shown);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mark_kept_all = on_publish == "delete" || kept == expected as i64;
    if seen.len() != expected || left != 0 || out_of_order != 0 || !mark_kept_all {
        bail!("the demo did not deliver every row exactly as expected");
    }
    step(
        "Done: every row arrived once with its id, same-key rows in id order, nothing left pending",
    );
    Ok(())
}

/// Rows not yet published, in either `on_publish` mode.
const PENDING: &str = "SELECT count(*) FROM outbox WHERE published_at IS NULL";

fn step(text: &str) {
    println!("\n==> {text}");
}

fn run(binary: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(binary).args(args).output()?;
    print!("    {}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        bail!(
            "{binary} {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

//! End-to-end demo on throwaway services: PostgreSQL + nats-server, 20,000 outbox rows
//! over 200 keys plus NULL-key rows plus one transaction that commits after later ids,
//! `outbox-relay migrate`, `outbox-relay drain`, then an independent consumer checks what
//! arrived. Run it through `scripts/demo`.
//!
//! Usage: demo PATH-TO-outbox-relay [ROWS] [delete|mark]

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use testkit::{NatsServer, Postgres};

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let relay = args
        .next()
        .context("usage: demo PATH-TO-outbox-relay [ROWS] [delete|mark]")?;
    let rows: i64 = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20_000);
    let on_publish = args.next().unwrap_or_else(|| "delete".to_owned());
    if on_publish != "delete" && on_publish != "mark" {
        bail!("the third argument is delete or mark, not {on_publish:?}");
    }

    step("Starting a throwaway PostgreSQL and nats-server -js on free 127.0.0.1 ports");
    let pg = Postgres::start()?;
    let nats = NatsServer::start()?;
    let db_url = pg.create_database("app").await?;
    nats.create_stream("OUTBOX", &["orders.>"]).await?;
    println!(
        "    postgres  {db_url}\n    nats      {} (stream OUTBOX on orders.>, 2m duplicate window)",
        nats.url()
    );

    let dir = std::env::temp_dir().join(format!("outbox-relay-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"{db_url}\"\n\n[relay]\nworkers = 4\nbatch_size = 500\n\
             on_publish = \"{on_publish}\"\n\n\
             [sink]\nkind = \"nats\"\n\n[sink.nats]\nurl = \"{}\"\n\n\
             [[tables]]\nname = \"public.outbox\"\ntopic = \"{{topic}}\"\n",
            nats.url()
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

    step("Reading the stream back with an independent consumer");
    let stored = nats.read_stream("OUTBOX").await?;
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in &stored {
        let id = m
            .header("Nats-Msg-Id")
            .context("message without Nats-Msg-Id")?
            .to_owned();
        let count = seen.entry(id.clone()).or_default();
        *count += 1;
        if let (1, Some(key)) = (*count, m.header("key")) {
            let n: i64 = id.rsplit(':').next().unwrap().parse()?;
            by_key.entry(key.to_owned()).or_default().push(n);
        }
    }
    let left: i64 = client.query_one(PENDING, &[]).await?.get(0);
    let kept: i64 = client
        .query_one("SELECT count(*) FROM outbox", &[])
        .await?
        .get(0);
    let expected = rows as usize + 1;
    let duplicates: usize = seen.values().map(|c| c - 1).sum();
    println!("    messages in stream      {}", stored.len());
    println!(
        "    distinct Nats-Msg-Id    {} (expected {expected})",
        seen.len()
    );
    let out_of_order = by_key
        .values()
        .filter(|ids| ids.windows(2).any(|w| w[0] >= w[1]))
        .count();
    println!("    duplicates              {duplicates}");
    println!(
        "    keys                    {} (out of id order: {out_of_order})",
        by_key.len()
    );
    println!(
        "    late row delivered      {}",
        seen.contains_key(&format!("public.outbox:{late_id}"))
    );
    println!("    rows left unpublished   {left} (rows kept in the table: {kept}, on_publish = {on_publish})");
    if let Some(first) = stored.first() {
        println!(
            "    first message           subject={} Nats-Msg-Id={} payload={}",
            first.subject,
            first.header("Nats-Msg-Id").unwrap_or(""),
            String::from_utf8_lossy(&first.payload)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mark_kept_all = on_publish == "delete" || kept == expected as i64;
    if seen.len() != expected || left != 0 || out_of_order != 0 || !mark_kept_all {
        bail!("the demo did not deliver every row exactly as expected");
    }
    step("Done: every row arrived once with its Nats-Msg-Id, same-key rows in id order, outbox empty");
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

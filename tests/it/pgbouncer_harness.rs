//! The PgBouncer harness works, and the environment it gives is the one the relay must
//! survive behind a default PgBouncer 1.18 in transaction mode: startup `options` are
//! refused, one client's statements do not stay on one server connection, and so a
//! prepared statement does not follow its client.

use testkit::{PgBouncer, PgBouncerOptions, Postgres};
use tokio_postgres::error::SqlState;
use tokio_postgres::{GenericClient, SimpleQueryMessage};

/// A cluster with database `app` and the login role `outbox_relay`, and a bouncer for it.
async fn cluster_and_bouncer(options: &PgBouncerOptions) -> (Postgres, PgBouncer) {
    let pg = Postgres::start().expect("start postgres");
    pg.create_database("app").await.expect("create database");
    pg.connect("app")
        .await
        .expect("connect")
        .batch_execute("CREATE ROLE outbox_relay LOGIN")
        .await
        .expect("create role");
    let bouncer = PgBouncer::start_with(&pg, options).expect("start pgbouncer");
    (pg, bouncer)
}

/// The server process serving this statement. A simple query on purpose: `query_one`
/// with a `&str` prepares a named statement and, when that is dropped, sends Close + Sync
/// in the background, which holds a server connection just after the result came back.
async fn backend_pid(client: &impl GenericClient) -> i32 {
    let messages = client
        .simple_query("SELECT pg_backend_pid()")
        .await
        .expect("pg_backend_pid");
    let row = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .expect("one row");
    row.get(0).expect("a pid").parse().expect("an integer pid")
}

#[tokio::test(flavor = "multi_thread")]
async fn both_roles_query_through_the_bouncer_as_themselves() {
    let (_pg, bouncer) = cluster_and_bouncer(&PgBouncerOptions::default()).await;
    for user in ["postgres", "outbox_relay"] {
        let client = bouncer.connect(user, "app").await.unwrap_or_else(|e| {
            panic!(
                "connect as {user}: {e:#}\npgbouncer log:\n{}",
                bouncer.log()
            )
        });
        let row = client
            .query_one("SELECT 1::int4, current_user::text", &[])
            .await
            .expect("SELECT 1");
        assert_eq!(row.get::<_, i32>(0), 1);
        // trust + auth_file logs into PostgreSQL as the client's user, not a pooled one.
        assert_eq!(row.get::<_, String>(1), user);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn startup_options_are_refused_with_08p01() {
    let (_pg, bouncer) = cluster_and_bouncer(&PgBouncerOptions::default()).await;
    let mut config: tokio_postgres::Config = bouncer.url("outbox_relay", "app").parse().unwrap();
    config.options("-c statement_timeout=1000");
    let err = match config.connect(tokio_postgres::NoTls).await {
        Ok(_) => panic!("a startup packet with `options` was accepted"),
        Err(e) => e,
    };
    let db = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {err:#}"));
    assert_eq!(db.code(), &SqlState::PROTOCOL_VIOLATION, "{db:?}");
    assert!(
        db.message().contains("unsupported startup parameter"),
        "{db:?}"
    );
}

/// Two clients of a bouncer with `pool_size = 2`, and exactly one server connection,
/// idle, which `a` used last (its pid is returned). Nothing else is ours to choose: a
/// login before the pool has learnt the server's parameters opens a server connection
/// of its own, so `b` logs in only after `a`'s first statement.
async fn one_idle_server_connection(
    bouncer: &PgBouncer,
) -> (tokio_postgres::Client, tokio_postgres::Client, i32) {
    let a = bouncer.connect("outbox_relay", "app").await.unwrap();
    let pid = backend_pid(&a).await;
    let b = bouncer.connect("outbox_relay", "app").await.unwrap();
    (a, b, pid)
}

fn pool_of_two() -> PgBouncerOptions {
    PgBouncerOptions {
        pool_size: Some(2),
        ..PgBouncerOptions::default()
    }
}

/// Deterministic: another client's open transaction takes the one idle server
/// connection, so this client's next statement gets a second one. (So a session `SET`,
/// a named prepared statement or a `LISTEN` does not follow the client.)
#[tokio::test(flavor = "multi_thread")]
async fn one_clients_autocommit_statements_can_land_on_different_server_connections() {
    let (_pg, bouncer) = cluster_and_bouncer(&pool_of_two()).await;
    let (a, mut b, first) = one_idle_server_connection(&bouncer).await;
    let holder = b.transaction().await.unwrap();
    assert_eq!(
        backend_pid(&holder).await,
        first,
        "the other client's transaction takes the one idle server connection\n{}",
        bouncer.log()
    );
    let second = backend_pid(&a).await;
    assert_ne!(first, second, "the same client, another server connection");
    holder.rollback().await.unwrap();
}

/// What tokio-postgres' `prepare` (and `query` with a `&str`, which prepares first) meets:
/// the statement is named on the server connection that parsed it, and 1.18 has no
/// `max_prepared_statements` to carry it over.
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_prepared_on_one_server_connection_is_missing_on_another() {
    let (_pg, bouncer) = cluster_and_bouncer(&pool_of_two()).await;
    let (a, mut b, _) = one_idle_server_connection(&bouncer).await;
    let statement = a.prepare("SELECT 1::int4").await.unwrap();
    let holder = b.transaction().await.unwrap();
    let err = a
        .query_one(&statement, &[])
        .await
        .expect_err("the prepared statement followed the client");
    let db = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {err:#}"));
    assert_eq!(db.code(), &SqlState::INVALID_SQL_STATEMENT_NAME, "{db:?}");
    holder.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_bouncer_drops_its_clients_and_serves_again_after_start_again() {
    let (_pg, mut bouncer) = cluster_and_bouncer(&PgBouncerOptions::default()).await;
    let before = bouncer.connect("postgres", "app").await.unwrap();
    bouncer.kill();
    assert!(before.simple_query("SELECT 1").await.is_err());
    bouncer.start_again().expect("start pgbouncer again");
    let after = bouncer.connect("postgres", "app").await.unwrap();
    after
        .simple_query("SELECT 1")
        .await
        .expect("SELECT 1 after restart");
}

//! Security promises: the relay runs as the least-privilege role of
//! `migrations/outbox_relay_role.sql` (every [`Env`] test does), `check` names each
//! missing privilege, and the role can do nothing beyond the relay's statements.

use crate::common::*;
use testkit::{NatsServer, Postgres, TestCa};

#[tokio::test(flavor = "multi_thread")]
async fn least_privilege_role_relays_but_cannot_truncate_insert_or_alter() {
    let env = Env::new(relay().retry_backoff("10ms")).await;
    let owner = env.client().await;
    seed(&owner, 500, 10, 0).await;
    let out = env.relay(&["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // Failures and dead-lettering (UPDATE of the bookkeeping columns) work as the role too.
    owner
        .execute(
            "INSERT INTO public.outbox (topic, key, payload) VALUES ('bad subject', 'k', 'x')",
            &[],
        )
        .await
        .unwrap();
    let out = env.relay(&["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("1 dead-lettered"), "{}", text(&out));
    assert_eq!(
        count(
            &owner,
            "SELECT count(*) FROM public.outbox WHERE dead_at IS NOT NULL"
        )
        .await,
        1,
        "the bad row was dead-lettered by outbox_relay"
    );
    assert_eq!(env.stored().await.len(), 500, "every good row published");
    let out = env.relay(&["requeue", "--all"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        count(
            &owner,
            "SELECT count(*) FROM public.outbox WHERE dead_at IS NULL"
        )
        .await,
        1,
        "requeue works as outbox_relay"
    );

    let (role, connection) =
        tokio_postgres::connect(&as_relay_role(&env.db_url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    for statement in [
        "TRUNCATE public.outbox",
        "INSERT INTO public.outbox (topic, payload) VALUES ('events.x', 'x')",
        "UPDATE public.outbox SET payload = 'changed'",
        "UPDATE public.outbox SET topic = 'events.other'",
        "ALTER TABLE public.outbox ADD COLUMN x int",
        "DROP TABLE public.outbox",
        "CREATE TABLE public.mine (id int)",
        "CREATE ROLE other",
    ] {
        let error = role
            .batch_execute(statement)
            .await
            .expect_err(&format!("outbox_relay must not run {statement}"));
        let code = error.code().map(|c| c.code().to_owned());
        assert_eq!(
            code.as_deref(),
            Some("42501"),
            "{statement}: insufficient_privilege, got {error:?}"
        );
    }
    let attributes = role
        .query_one(
            "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls \
             FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .unwrap();
    for i in 0..5 {
        assert!(!attributes.get::<_, bool>(i), "role attribute {i} is off");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn check_names_each_missing_privilege_and_the_grant_that_fixes_it() {
    let env = Env::new(relay()).await;
    let owner = env.client().await;
    owner
        .batch_execute(
            "REVOKE DELETE ON public.outbox FROM outbox_relay;
             REVOKE UPDATE (dead_at) ON public.outbox FROM outbox_relay;",
        )
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        stdout.contains(
            "this role lacks DELETE: GRANT DELETE ON \"public\".\"outbox\" TO <relay role>"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "this role lacks UPDATE on column dead_at: GRANT UPDATE (\"dead_at\") ON \
             \"public\".\"outbox\" TO <relay role>"
        ),
        "{stdout}"
    );
    assert!(
        !stdout.contains("column attempts"),
        "attempts is granted: {stdout}"
    );

    // In mark mode DELETE is not needed, UPDATE of published_at is.
    owner
        .batch_execute(
            "GRANT UPDATE (dead_at) ON public.outbox TO outbox_relay;
             REVOKE UPDATE (published_at) ON public.outbox FROM outbox_relay;",
        )
        .await
        .unwrap();
    env.write_config(&relay().on_publish("mark"));
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(!stdout.contains("lacks DELETE"), "{stdout}");
    assert!(
        stdout.contains("this role lacks UPDATE on column published_at"),
        "{stdout}"
    );
    // ... unless relay.retention deletes old published rows: then DELETE is needed again.
    env.write_config(&relay().on_publish("mark").retention("7d"));
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        stdout.contains(
            "this role lacks DELETE (relay.retention deletes old published rows): GRANT DELETE \
             ON \"public\".\"outbox\" TO <relay role>"
        ),
        "{stdout}"
    );
    env.write_config(&relay().on_publish("mark"));

    owner
        .batch_execute("REVOKE USAGE ON SCHEMA public FROM outbox_relay, PUBLIC")
        .await
        .unwrap();
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        stdout.contains(
            "this role lacks USAGE on schema \"public\": GRANT USAGE ON SCHEMA \"public\" TO \
             <relay role>"
        ),
        "{stdout}"
    );
}

/// The URL of `env`'s database as `outbox_relay` with `password`, reached as `host`
/// (`hostaddr` keeps the connection on 127.0.0.1), plus `params`.
fn tls_url(env: &Env, host: &str, password: &str, params: &str) -> String {
    format!(
        "postgres://outbox_relay:{password}@{host}:{}/app?hostaddr=127.0.0.1&{params}",
        env.pg.port()
    )
}

/// `command`'s arguments, with a `--timeout` for `drain`.
fn bounded(command: &str) -> Vec<&str> {
    match command {
        "drain" => vec!["drain", "--timeout", "60s"],
        other => vec![other],
    }
}

fn with_url(env: &Env, url: &str, args: &[&str]) -> std::process::Output {
    env.command(args)
        .env("OUTBOX_RELAY__POSTGRES__URL", url)
        .output_within(RUN_LIMIT)
        .unwrap()
}

const PASSWORD: &str = "Tr0ub4dor-never-printed";

#[tokio::test(flavor = "multi_thread")]
async fn verify_full_drains_over_tls_and_refuses_a_wrong_ca_or_host_name() {
    let ca = testkit::TestCa::new().unwrap();
    let other_ca = testkit::TestCa::new().unwrap();
    let env = Env::on(
        Postgres::start_tls(&ca).unwrap(),
        NatsServer::start().unwrap(),
        relay(),
    )
    .await;
    let owner = env.client().await;
    owner
        .batch_execute(&format!("ALTER ROLE outbox_relay PASSWORD '{PASSWORD}'"))
        .await
        .unwrap();
    seed(&owner, 300, 10, 0).await;
    let root = |ca: &testkit::TestCa| ca.ca_cert().display().to_string();

    // The right CA and the name in the certificate: drains. pg_hba rejects outbox_relay
    // without TLS, so success means the session was encrypted.
    let good = tls_url(
        &env,
        "127.0.0.1",
        PASSWORD,
        &format!("sslmode=verify-full&sslrootcert={}", root(&ca)),
    );
    let out = with_url(&env, &good, &["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = with_url(&env, &good, &["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(env.stored().await.len(), 300);

    // No chain to check (`require`, and `prefer`, the default): the connector is built at
    // the first handshake instead of at start-up, and the handshake does happen (pg_hba
    // refuses outbox_relay in plain text), whatever name the certificate lists.
    for params in ["sslmode=require", "sslmode=prefer"] {
        let url = tls_url(&env, "db.wrong.example", PASSWORD, params);
        for command in ["check", "drain"] {
            let out = with_url(&env, &url, &bounded(command));
            assert_eq!(
                out.status.code(),
                Some(0),
                "{params} {command}: {}",
                text(&out)
            );
        }
    }

    // A CA that did not sign the server's certificate.
    let wrong_ca = tls_url(
        &env,
        "127.0.0.1",
        PASSWORD,
        &format!("sslmode=verify-full&sslrootcert={}", root(&other_ca)),
    );
    for command in ["check", "drain"] {
        let out = with_url(&env, &wrong_ca, &bounded(command));
        assert_eq!(out.status.code(), Some(1), "{command}: {}", text(&out));
        assert!(
            text(&out).contains("not signed by a CA in sslrootcert"),
            "{command}: {}",
            text(&out)
        );
        assert!(!text(&out).contains(PASSWORD), "{}", text(&out));
    }

    // The right CA, but a host name the certificate does not list.
    let wrong_host = tls_url(
        &env,
        "db.wrong.example",
        PASSWORD,
        &format!("sslmode=verify-full&sslrootcert={}", root(&ca)),
    );
    let out = with_url(&env, &wrong_host, &["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("does not name the host"),
        "{}",
        text(&out)
    );
    // The server asks for a password the URL does not give: the client refuses before
    // asking, which no retry changes, so drain stops at once naming it (it used to retry
    // it as "not reachable yet" until its timeout).
    let no_password = format!(
        "postgres://outbox_relay@127.0.0.1:{}/app?sslmode=verify-full&sslrootcert={}",
        env.pg.port(),
        root(&ca)
    );
    let started = std::time::Instant::now();
    let out = with_url(&env, &no_password, &["drain", "--timeout", "30s"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("password missing"), "{}", text(&out));
    assert!(
        started.elapsed() < std::time::Duration::from_secs(15),
        "retried for {:?}: {}",
        started.elapsed(),
        text(&out)
    );

    // verify-ca checks the chain only: the same host name passes.
    let out = with_url(
        &env,
        &wrong_host.replace("verify-full", "verify-ca"),
        &["check"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // A client certificate is sent when given (and a key that does not match is refused).
    let with_client_cert = format!(
        "{good}&sslcert={}&sslkey={}",
        ca.client_cert().display(),
        ca.client_key().display()
    );
    let out = with_url(&env, &with_client_cert, &["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let mismatched = format!(
        "{good}&sslcert={}&sslkey={}",
        ca.client_cert().display(),
        other_ca.client_key().display()
    );
    let out = with_url(&env, &mismatched, &["check"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("does not belong to sslcert"),
        "{}",
        text(&out)
    );

    // A wrong password: refused, and neither password appears anywhere.
    let wrong_password = "Wr0ng-pa55word-also-secret";
    let bad = tls_url(
        &env,
        "127.0.0.1",
        wrong_password,
        &format!("sslmode=verify-full&sslrootcert={}", root(&ca)),
    );
    for command in ["check", "drain", "status"] {
        let out = with_url(&env, &bad, &bounded(command));
        assert_eq!(out.status.code(), Some(1), "{command}: {}", text(&out));
        assert!(
            text(&out).contains("password authentication failed"),
            "{command}: {}",
            text(&out)
        );
        assert!(
            !text(&out).contains(wrong_password),
            "{command}: {}",
            text(&out)
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_asked_for_is_never_given_up_for_a_plain_connection() {
    // This server has no TLS at all.
    let env = Env::new(relay()).await;
    let url = format!("{}?sslmode=require", as_relay_role(&env.db_url));
    for command in ["check", "drain"] {
        let out = with_url(&env, &url, &bounded(command));
        assert_eq!(out.status.code(), Some(1), "{command}: {}", text(&out));
        assert!(
            text(&out).contains("does not offer TLS"),
            "{command}: {}",
            text(&out)
        );
    }
    // Without sslmode (prefer) the same server is used in plain text, as with libpq.
    let out = with_url(&env, &as_relay_role(&env.db_url), &["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    let out = with_url(
        &env,
        &format!("{url}&sslrootcert=/nonexistent/root.crt"),
        &["check"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("postgres.url: sslrootcert /nonexistent/root.crt does not exist"),
        "{}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_over_tls_with_an_nkey_and_secrets_from_files_never_printed() {
    let ca = TestCa::new().unwrap();
    let other_ca = TestCa::new().unwrap();
    let (nats, nkey_seed) = NatsServer::start_secure(&ca).unwrap();
    let env = Env::on(Postgres::start_tls(&ca).unwrap(), nats, relay()).await;
    let owner = env.client().await;
    owner
        .batch_execute(&format!("ALTER ROLE outbox_relay PASSWORD '{PASSWORD}'"))
        .await
        .unwrap();
    seed(&owner, 200, 5, 0).await;
    let dir = std::env::temp_dir().join(format!("outbox-relay-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let password_file = dir.join("pg-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let nkey_file = dir.join("nats.nk");
    std::fs::write(&nkey_file, format!("{nkey_seed}\n")).unwrap();
    // The password comes from a file, not the URL.
    let url = format!(
        "postgres://outbox_relay@127.0.0.1:{}/app?sslmode=verify-full&sslrootcert={}",
        env.pg.port(),
        ca.ca_cert().display()
    );
    let secure = |ca_file: &std::path::Path, args: &[&str]| {
        env.command(args)
            .env("OUTBOX_RELAY__POSTGRES__URL", &url)
            .env("OUTBOX_RELAY__POSTGRES__PASSWORD_FILE", &password_file)
            .env(
                "OUTBOX_RELAY__SINK__NATS__URL",
                env.nats.url().replace("nats://", "tls://"),
            )
            .env("OUTBOX_RELAY__SINK__NATS__NKEY_FILE", &nkey_file)
            .env("OUTBOX_RELAY__SINK__NATS__TLS_CA_FILE", ca_file)
            .env("RUST_LOG", "debug")
            .output_within(RUN_LIMIT)
            .unwrap()
    };
    let out = secure(&ca.ca_cert(), &["check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = secure(&ca.ca_cert(), &["drain", "--timeout", "60s"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(env.stored().await.len(), 200);
    for shown in [text(&out), text(&secure(&ca.ca_cert(), &["check"]))] {
        assert!(!shown.contains(PASSWORD), "{shown}");
        assert!(!shown.contains(&nkey_seed), "{shown}");
    }

    // The broker's certificate from another CA: refused, seed still not shown.
    let out = secure(&other_ca.ca_cert(), &["check"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("FAIL nats"), "{}", text(&out));
    assert!(!text(&out).contains(&nkey_seed), "{}", text(&out));

    // Without the nkey the server refuses the relay.
    let out = env
        .command(&["check"])
        .env("OUTBOX_RELAY__POSTGRES__URL", &url)
        .env("OUTBOX_RELAY__POSTGRES__PASSWORD_FILE", &password_file)
        .env("OUTBOX_RELAY__SINK__NATS__TLS_CA_FILE", ca.ca_cert())
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Identifiers from the config reach SQL only quoted: random names built to break quoting
/// (quotes, dots, `--`, `$$`, `;`, multi-byte) come back from PostgreSQL unchanged, and a
/// table whose schema, name and columns are such names relays like any other.
#[tokio::test(flavor = "multi_thread")]
async fn adversarial_identifiers_are_quoted_for_postgresql() {
    use outbox_relay::config::{adversarial_ident, Ident};
    use rand::SeedableRng;

    let env = Env::new(relay()).await;
    let owner = env.client().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for _ in 0..500 {
        let name = adversarial_ident(&mut rng);
        let quoted = Ident::parse(&format!("\"{}\"", name.replace('"', "\"\"")))
            .unwrap()
            .quoted();
        let rows = owner
            .query(&format!("SELECT 1 AS {quoted}"), &[])
            .await
            .unwrap_or_else(|e| panic!("{quoted}: {e}"));
        assert_eq!(rows[0].columns()[0].name(), name);
    }

    // A whole table of such names: created with PostgreSQL's own quoting (quote_ident), then
    // mapped in the config and relayed.
    let [schema, table, key, body] = [0; 4].map(|_| adversarial_ident(&mut rng));
    let toml_ident =
        |n: &str| toml::Value::String(format!("\"{}\"", n.replace('"', "\"\""))).to_string();
    let create = format!(
        "CREATE SCHEMA {s}; CREATE TABLE {s}.{t} (id bigint GENERATED ALWAYS AS IDENTITY \
         PRIMARY KEY, topic text NOT NULL, {k} text, {b} bytea)",
        s = quote_by_server(&owner, &schema).await,
        t = quote_by_server(&owner, &table).await,
        k = quote_by_server(&owner, &key).await,
        b = quote_by_server(&owner, &body).await,
    );
    owner.batch_execute(&create).await.unwrap();
    let full = format!(
        "{}.{}",
        quote_by_server(&owner, &schema).await,
        quote_by_server(&owner, &table).await
    );
    owner
        .batch_execute(&format!(
            "INSERT INTO {full} (topic, {k}, {b}) SELECT 'events.odd', 'k' || (n % 3), 'x' \
             FROM generate_series(1, 50) n",
            k = quote_by_server(&owner, &key).await,
            b = quote_by_server(&owner, &body).await,
        ))
        .await
        .unwrap();
    env.write_config(&relay().section(&format!(
        "[[tables]]\nname = {}\n[tables.columns]\nkey = {}\npayload = {}\n",
        toml::Value::String(format!(
            "\"{}\".\"{}\"",
            schema.replace('"', "\"\""),
            table.replace('"', "\"\"")
        )),
        toml_ident(&key),
        toml_ident(&body),
    )));
    let migrate = env.migrate(&[]);
    assert!(migrate.status.success(), "{}", text(&migrate));
    // Owner's URL: the role file names public.outbox only.
    let out = env
        .command(&["drain", "--timeout", "60s"])
        .env("OUTBOX_RELAY__POSTGRES__URL", &env.db_url)
        .output_within(RUN_LIMIT)
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("drained: 50 rows"), "{}", text(&out));
    assert_eq!(
        count(&owner, &format!("SELECT count(*) FROM {full}")).await,
        0
    );
}

/// PostgreSQL's own quoting of `name`, independent of the relay's.
async fn quote_by_server(client: &tokio_postgres::Client, name: &str) -> String {
    client
        .query_one("SELECT quote_ident($1)", &[&name])
        .await
        .unwrap()
        .get(0)
}

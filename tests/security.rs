//! Security promises: the relay runs as the least-privilege role of
//! `migrations/outbox_relay_role.sql` (every [`Env`] test does), `check` names each
//! missing privilege, and the role can do nothing beyond the relay's statements.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn least_privilege_role_relays_but_cannot_truncate_insert_or_alter() {
    let env = Env::new("").await;
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
    let out = env.relay(&["drain"]);
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
    let env = Env::new("").await;
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
    env.write_config("on_publish = \"mark\"", "");
    let out = env.relay(&["check"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(!stdout.contains("lacks DELETE"), "{stdout}");
    assert!(
        stdout.contains("this role lacks UPDATE on column published_at"),
        "{stdout}"
    );

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

//! The harness cleans up after an owner that died without unwinding (SIGKILL, a test
//! runner's timeout, Ctrl-C of `outbox-bench`): its servers die with it, and its scratch
//! directories, which no `Drop` removed, are removed when the next server starts. A
//! benchmark's PostgreSQL directory is gigabytes; left behind run after run, they filled
//! the disk.

use std::process::Command;

use testkit::NatsServer;

#[tokio::test]
async fn a_dead_owner_s_scratch_directories_are_removed_when_the_next_server_starts() {
    let tmp = std::env::temp_dir();
    // A pid no process has now: a child that exited and was reaped.
    let mut gone = Command::new("true").spawn().expect("spawn true");
    gone.wait().expect("wait for true");
    let orphaned = [
        tmp.join(format!("outbox-relay-pg-{}-0", gone.id())),
        tmp.join(format!("outbox-relay-pg-standby-{}-7", gone.id())),
    ];
    for dir in &orphaned {
        std::fs::create_dir_all(dir.join("data/base")).expect("create an orphaned dir");
        std::fs::write(dir.join("data/base/16384"), [0u8; 8192]).expect("write a file");
    }
    // A live owner's directory, and a name that is not a scratch directory's, stay.
    let mut owner = Command::new("sleep")
        .arg("60")
        .spawn()
        .expect("spawn sleep");
    let kept = [
        tmp.join(format!("outbox-relay-nats-{}-3", owner.id())),
        tmp.join(format!("outbox-relay-notes-{}", gone.id())),
    ];
    for dir in &kept {
        std::fs::create_dir_all(dir).expect("create a dir that must stay");
    }

    let _nats = NatsServer::start().expect("start nats-server");

    let left: Vec<_> = orphaned.iter().filter(|d| d.exists()).collect();
    let removed: Vec<_> = kept.iter().filter(|d| !d.exists()).collect();
    let _ = owner.kill();
    let _ = owner.wait();
    for dir in orphaned.iter().chain(&kept) {
        let _ = std::fs::remove_dir_all(dir);
    }
    assert!(
        left.is_empty(),
        "the dead owner's directories were left behind: {left:?}"
    );
    assert!(
        removed.is_empty(),
        "directories that are not a dead owner's were removed: {removed:?}"
    );
}

//! Counting NOTIFYs from outside: a LISTEN session of the caller's own, so a test or the
//! benchmark sees how many of the writers' commits notified.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A LISTEN session and the notifications it has heard; it listens while this lives.
pub struct Notifications {
    heard: Arc<AtomicUsize>,
    _session: tokio_postgres::Client,
}

impl Notifications {
    /// Listens on `channel` of the database at `url`, counting every notification, or
    /// with `payload` only those that carry it. PostgreSQL folds a transaction's identical
    /// notifications into one, so this counts the transactions that notified.
    pub async fn listen(
        url: &str,
        channel: &str,
        payload: Option<&str>,
    ) -> Result<Notifications, tokio_postgres::Error> {
        let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        let heard = Arc::new(AtomicUsize::new(0));
        let counter = heard.clone();
        let payload = payload.map(str::to_owned);
        // Ends when the client is dropped: the connection closes.
        tokio::spawn(async move {
            while let Some(Ok(message)) =
                std::future::poll_fn(|cx| connection.poll_message(cx)).await
            {
                if let tokio_postgres::AsyncMessage::Notification(n) = message {
                    if payload.as_deref().is_none_or(|p| p == n.payload()) {
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        });
        client.batch_execute(&format!("LISTEN {channel}")).await?;
        Ok(Notifications {
            heard,
            _session: client,
        })
    }

    /// The notifications heard so far.
    pub fn count(&self) -> usize {
        self.heard.load(Ordering::SeqCst)
    }
}

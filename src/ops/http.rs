//! The HTTP endpoints (only when `[http] listen` is set): `/metrics` in the Prometheus
//! text format, `/healthz` and `/readyz` (200 with `ok`, or 503 with the reason).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;

use super::Ops;

/// `[http] listen` could not be bound (the port taken, the address not this host's).
#[derive(Debug, thiserror::Error)]
#[error("http.listen: cannot listen on {listen}: {source}")]
pub struct BindError {
    listen: SocketAddr,
    source: std::io::Error,
}

/// Binds `listen` now, so a taken port fails the start, not a later scrape.
pub(crate) async fn bind(listen: SocketAddr) -> Result<tokio::net::TcpListener, BindError> {
    tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| BindError { listen, source })
}

/// Serves until `stop` fires.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    ops: Arc<Ops>,
    stop: CancellationToken,
) {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(ops);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
    {
        tracing::error!(error = %e, "HTTP server failed");
    }
}

async fn metrics(State(ops): State<Arc<Ops>>) -> Response {
    ops.scraped();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ops.metrics.encode(),
    )
        .into_response()
}

fn verdict(result: Result<(), String>) -> Response {
    match result {
        Ok(()) => (StatusCode::OK, "ok\n").into_response(),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")).into_response(),
    }
}

async fn healthz(State(ops): State<Arc<Ops>>) -> Response {
    verdict(ops.health.liveness())
}

async fn readyz(State(ops): State<Arc<Ops>>) -> Response {
    verdict(ops.health.readiness())
}

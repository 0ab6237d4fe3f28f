//! The operations endpoint of `run` and `drain`: `/metrics` (Prometheus text), `/health/live`
//! and `/health/ready`; every other path is 404.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox::{Error, OutboxAdmin, Publisher};
use serde_json::json;

use crate::TARGET;

/// What readiness checks: one outbox's store and broker, or every outbox of a fleet.
#[derive(Clone)]
pub enum Ready {
    /// One outbox.
    One {
        /// The store, for `ping`.
        admin: Arc<dyn OutboxAdmin>,
        /// The broker, for `check`.
        publisher: Arc<dyn Publisher>,
    },
    /// The outboxes of a `[[outbox]]` configuration: ready when every one is, `degraded`
    /// (still 200) when some are, 503 when none is; `?all` makes anything short of all 503.
    Many(crate::multi::Fleet),
}

/// What the endpoints look at.
#[derive(Clone)]
pub struct Probe {
    /// What readiness checks.
    pub ready: Ready,
    /// How long readiness waits for each.
    pub timeout: Duration,
    /// The exporter's handle, rendered on `/metrics`.
    pub metrics: PrometheusHandle,
    /// The process loop's heartbeat (see [`Heartbeat`]).
    pub heartbeat: Heartbeat,
}

/// Beats of the program's gauge loop: `/health/live` fails when it stopped beating.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    start: Instant,
    last_ms: Arc<AtomicU64>,
    /// Longest silence that still counts as alive.
    pub allowed: Duration,
}

impl Heartbeat {
    /// A heartbeat that beat now.
    pub fn new(allowed: Duration) -> Self {
        Self {
            start: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
            allowed,
        }
    }

    /// Record a beat.
    pub fn beat(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn silent_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// Bind `addr` now (so a taken port fails the start-up) and serve in a task.
pub async fn serve(addr: SocketAddr, probe: Probe) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::invalid_input(format!("cannot serve metrics on {addr}: {e}")))?;
    tracing::info!(target: TARGET, %addr, "serving /metrics, /health/live and /health/ready");
    Ok(tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(target: TARGET, error = %e, "accept failed");
                    continue;
                }
            };
            let probe = probe.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let probe = probe.clone();
                    async move { Ok::<_, Infallible>(respond(&probe, req).await) }
                });
                if let Err(e) = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(target: TARGET, error = %e, "metrics connection ended");
                }
            });
        }
    }))
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

async fn respond<B>(probe: &Probe, req: Request<B>) -> Response<Full<Bytes>> {
    const JSON: &str = "application/json";
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            JSON,
            json!({"error": "only GET"}).to_string(),
        );
    }
    match req.uri().path() {
        "/metrics" => reply(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            probe.metrics.render(),
        ),
        "/health/live" => {
            let silent = probe.heartbeat.silent_for();
            if silent <= probe.heartbeat.allowed {
                reply(StatusCode::OK, JSON, json!({"status": "live"}).to_string())
            } else {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    JSON,
                    json!({"status": "stalled",
                           "reason": format!("the process loop has not run for {silent:?}")})
                    .to_string(),
                )
            }
        }
        "/health/ready" => {
            let (admin, publisher) = match &probe.ready {
                Ready::One { admin, publisher } => (admin, publisher),
                Ready::Many(fleet) => {
                    let (all, any, body) = fleet.ready(probe.timeout).await;
                    let strict = req
                        .uri()
                        .query()
                        .is_some_and(|q| q.split('&').any(|p| p == "all"));
                    let ok = if strict { all } else { any };
                    let status = if ok {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    };
                    return reply(status, JSON, body.to_string());
                }
            };
            let (store, broker) = ready(admin.as_ref(), publisher.as_ref(), probe.timeout).await;
            let ok = store.is_ok() && broker.is_ok();
            let show = |r: &Result<(), String>| match r {
                Ok(()) => json!("ok"),
                Err(e) => json!(e),
            };
            let body = json!({
                "status": if ok { "ready" } else { "not ready" },
                "store": show(&store),
                "broker": show(&broker),
            });
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            reply(status, JSON, body.to_string())
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            JSON,
            json!({"error": "not found; try /metrics, /health/live or /health/ready"}).to_string(),
        ),
    }
}

/// Ping the store and check the broker, together, each within the timeout.
pub async fn ready(
    admin: &dyn OutboxAdmin,
    publisher: &dyn Publisher,
    timeout: Duration,
) -> (Result<(), String>, Result<(), String>) {
    tokio::join!(
        bounded("store", timeout, admin.ping()),
        bounded("broker", timeout, publisher.check()),
    )
}

/// `check`, within `timeout`: its error (redacted) or a timeout naming `what`.
pub async fn bounded(
    what: &str,
    timeout: Duration,
    check: impl std::future::Future<Output = Result<(), Error>>,
) -> Result<(), String> {
    match tokio::time::timeout(timeout, check).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(outbox::redact_url(&e.to_string())),
        Err(_) => Err(format!("{what} did not answer within {timeout:?}")),
    }
}

//! OTLP export of the relay's producer spans (feature `otel`, in the default build): an SDK
//! tracer provider with a batch processor and the HTTP/protobuf exporter, installed as the
//! global provider, and the relay's [`Traces`] for the broker URL.

use std::path::Path;
use std::time::Duration;

use opentelemetry_otlp::{SpanExporter, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use outbox::relay::{Relay, Traces};
use outbox::Error;
use outbox_routing::RoutingTemplate;

use crate::settings::OtelSettings;

#[cfg(feature = "kafka")]
use outbox::kafka::DEFAULT_TOPIC_TEMPLATE;
#[cfg(not(feature = "kafka"))]
const DEFAULT_TOPIC_TEMPLATE: &str = "outbox.{aggregate_type}";

/// The installed exporter; [`Exporter::shutdown`] sends what is still buffered.
pub struct Exporter {
    provider: SdkTracerProvider,
}

/// Build the exporter (other `OTEL_EXPORTER_OTLP_*` variables, such as headers, timeout and
/// compression, are read by the exporter itself) and install it as the global provider.
pub async fn install(settings: &OtelSettings) -> Result<Exporter, Error> {
    let settings = settings.clone();
    // The blocking HTTP client may not be built (or dropped) on a runtime thread.
    let provider = tokio::task::spawn_blocking(move || {
        let client = http_client(&settings)?;
        let exporter = SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(settings.endpoint.clone())
            .build()
            .map_err(|e| {
                Error::invalid_input(format!(
                    "cannot build the OTLP exporter for {}: {e}",
                    crate::settings::mask_url(&settings.endpoint)
                ))
            })?;
        Ok::<_, Error>(
            SdkTracerProvider::builder()
                .with_resource(
                    Resource::builder()
                        .with_service_name(settings.service_name.clone())
                        .build(),
                )
                .with_batch_exporter(exporter)
                .build(),
        )
    })
    .await
    .map_err(|e| Error::permanent(format!("OTLP exporter set-up failed: {e}"), None))??;
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(Exporter { provider })
}

/// How long one export may take when `OTEL_EXPORTER_OTLP_TIMEOUT` does not say: the
/// specification's default.
const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The exporter's blocking HTTP client: rustls (ring) verifying an `https://` collector against
/// the system's roots plus the configured CA file, presenting the client certificate if one is
/// set, with the export timeout of `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` or
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds). Built on a blocking thread.
fn http_client(settings: &OtelSettings) -> Result<reqwest::blocking::Client, Error> {
    // rustls needs one crypto provider per process; another part of the program (a driver) may
    // have installed it already, which is just as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let timeout = [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok()?.trim().parse::<u64>().ok())
    .map_or(DEFAULT_EXPORT_TIMEOUT, Duration::from_millis);
    let mut builder = reqwest::blocking::Client::builder().timeout(timeout);
    if let Some(ca) = &settings.certificate {
        let certs = reqwest::Certificate::from_pem_bundle(&read_pem(ca, "CA certificates")?)
            .map_err(|e| {
                Error::invalid_input(format!(
                    "OTLP export: {} holds no PEM CA certificate: {e}",
                    ca.display()
                ))
            })?;
        builder = builder.tls_certs_merge(certs);
    }
    if let Some((cert, key)) = &settings.client_identity {
        let mut pem = read_pem(cert, "client certificate")?;
        pem.push(b'\n');
        pem.extend(read_pem(key, "client key")?);
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
            Error::invalid_input(format!(
                "OTLP export: {} and {} are not a PEM certificate and its private key: {e}",
                cert.display(),
                key.display()
            ))
        })?;
        builder = builder.identity(identity);
    }
    builder.build().map_err(|e| {
        Error::invalid_input(format!(
            "cannot build the OTLP exporter's HTTP client for {}: {e}",
            crate::settings::mask_url(&settings.endpoint)
        ))
    })
}

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| {
        Error::invalid_input(format!(
            "OTLP export: cannot read the {what} file {}: {e}",
            path.display()
        ))
    })
}

impl Exporter {
    /// Flush the spans still buffered and stop the exporter.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(target: crate::TARGET, error = %e, "OTLP exporter shutdown failed; the last spans may be lost");
        }
    }
}

/// `relay` with producer spans named for the broker URL: `messaging.system` is the
/// publisher's name, the destination its routing template (the URL's `subject`, `topic` or
/// `stream`; Kafka's default when unset).
pub fn traced(relay: Relay, system: &str, broker_url: &str) -> Relay {
    let mut traces = Traces::global(system.to_owned());
    if let Some(template) = destination_template(broker_url) {
        traces = traces.with_destination(template);
    }
    relay.with_traces(traces)
}

fn destination_template(broker_url: &str) -> Option<RoutingTemplate> {
    let url = url::Url::parse(broker_url).ok()?;
    let key = match url.scheme() {
        "nats" | "tls" => "subject",
        "kafka" => "topic",
        "redis" | "rediss" => "stream",
        _ => return None,
    };
    let text = url
        .query_pairs()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
        .or_else(|| (key == "topic").then(|| DEFAULT_TOPIC_TEMPLATE.to_owned()))?;
    RoutingTemplate::parse(&text).ok()
}

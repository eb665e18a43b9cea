//! The server's Prometheus metrics (`GET /metrics`, text format).

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Requests by route and HTTP status.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: String,
}

/// A label with the policy preset's name.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub policy: String,
}

/// Why a generation was cut short: `disconnect`, `timeout` or `shutdown`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// Every metric, registered once.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Counter,
    pub completion_tokens: Counter,
    /// Admitted requests waiting for a place in the batch.
    pub queue_depth: Gauge,
    /// Generations running.
    pub active_sequences: Gauge,
    /// KV bytes (hot + cold) held by running generations, per policy.
    pub kv_resident_bytes: Family<PolicyLabel, Gauge>,
    pub cancelled: Family<ReasonLabel, Counter>,
    /// Passages retrievals of RAG requests.
    pub retrievals: Counter,
    /// The scheduler's KV budget (0: none), the bytes its sequences reserved, the
    /// bytes their caches hold, and the sequences in the batch.
    pub kv_budget_bytes: Gauge,
    pub kv_reserved_bytes: Gauge,
    pub kv_used_bytes: Gauge,
    pub batch_size: Gauge,
    /// Batched decode steps, and the rows they ran (mean batch = rows / steps).
    pub batch_steps: Gauge,
    pub batch_rows: Gauge,
    /// Prompt positions run as rows of batched steps (`prefill_chunk = 1`), and the
    /// steps that ran some beside decoding sequences.
    pub batch_prompt_rows: Gauge,
    pub batch_mixed_steps: Gauge,
    /// Requests that continued a shared prefix, the prompt tokens they did not prefill,
    /// and the bytes the prefix cache holds.
    pub prefix_hits: Gauge,
    pub prefix_tokens: Gauge,
    pub prefix_bytes: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("headwise");
        let requests = Family::<RequestLabels, Counter>::default();
        let prompt_tokens = Counter::default();
        let completion_tokens = Counter::default();
        let queue_depth = Gauge::default();
        let active_sequences = Gauge::default();
        let kv_resident_bytes = Family::<PolicyLabel, Gauge>::default();
        let cancelled = Family::<ReasonLabel, Counter>::default();
        let retrievals = Counter::default();
        let gauges: [Gauge; 11] = Default::default();
        for (name, help, g) in [
            (
                "kv_budget_bytes",
                "KV bytes the scheduler may reserve (0: no budget)",
                &gauges[0],
            ),
            (
                "kv_reserved_bytes",
                "KV bytes reserved by admitted sequences",
                &gauges[1],
            ),
            (
                "kv_used_bytes",
                "KV bytes the admitted sequences' caches hold (shared prefix rows counted in prefix_bytes)",
                &gauges[2],
            ),
            ("batch_size", "Sequences admitted to the batch", &gauges[3]),
            ("batch_steps", "Batched decode steps run", &gauges[4]),
            (
                "batch_rows",
                "Sequence steps run in batched decode steps",
                &gauges[5],
            ),
            (
                "prefix_hits",
                "Requests that continued a shared prefix",
                &gauges[6],
            ),
            (
                "prefix_tokens",
                "Prompt tokens taken from shared prefixes",
                &gauges[7],
            ),
            ("prefix_bytes", "Bytes the prefix cache holds", &gauges[8]),
            (
                "batch_prompt_rows",
                "Prompt positions run as rows of batched steps",
                &gauges[9],
            ),
            (
                "batch_mixed_steps",
                "Batched steps that ran prompt positions beside decoding sequences",
                &gauges[10],
            ),
        ] {
            registry.register(name, help, g.clone());
        }
        let [kv_budget_bytes, kv_reserved_bytes, kv_used_bytes, batch_size, batch_steps, batch_rows, prefix_hits, prefix_tokens, prefix_bytes, batch_prompt_rows, batch_mixed_steps] =
            gauges;
        registry.register(
            "requests",
            "HTTP requests by endpoint and status",
            requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of finished generations",
            prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Generated tokens of finished generations",
            completion_tokens.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests waiting for a place in the batch",
            queue_depth.clone(),
        );
        registry.register(
            "active_sequences",
            "Generations running",
            active_sequences.clone(),
        );
        registry.register(
            "kv_resident_bytes",
            "KV cache bytes held by running generations",
            kv_resident_bytes.clone(),
        );
        registry.register(
            "cancelled",
            "Generations cut short, by reason",
            cancelled.clone(),
        );
        registry.register(
            "retrievals",
            "Retrievals made by RAG requests",
            retrievals.clone(),
        );
        Self {
            registry,
            retrievals,
            requests,
            prompt_tokens,
            completion_tokens,
            queue_depth,
            active_sequences,
            kv_resident_bytes,
            cancelled,
            kv_budget_bytes,
            kv_reserved_bytes,
            kv_used_bytes,
            batch_size,
            batch_steps,
            batch_rows,
            batch_prompt_rows,
            batch_mixed_steps,
            prefix_hits,
            prefix_tokens,
            prefix_bytes,
        }
    }
}

impl Metrics {
    /// Count a response.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.into(),
                status: status.to_string(),
            })
            .inc();
    }

    /// The KV gauge of `policy`.
    pub fn kv(&self, policy: &str) -> Gauge {
        self.kv_resident_bytes
            .get_or_create(&PolicyLabel {
                policy: policy.into(),
            })
            .clone()
    }

    /// Count a cut-short generation.
    pub fn cancel(&self, reason: &str) {
        self.cancelled
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; a failed encoder would give a short page.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

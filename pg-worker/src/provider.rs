//! The payment provider's status client: before the closer closes an order that never got a
//! callback, it asks the provider what became of the payment (DESIGN.md section 6: the closer
//! releases a unit only on an authoritative "unpaid").
//!
//! What it is: [`Provider::ask`], one signed status request with a bounded deadline per
//! attempt and a bounded number of attempts, and its answer reduced to [`Answer`]:
//!
//! - request: `POST {status_url}` with the JSON body
//!   `{"order_id":"..","nonce":"<32 hex>","requested_at_ms":N,"signature":"<64 hex>"}`, the
//!   signature over `v1|status_request|order_id|nonce|requested_at_ms` with the payment key
//!   (`flashsale_io::payment::StatusRequest`);
//! - answer: `200` with `{"order_id":"..","payment_id":"..","status":"..","amount_cents":N,
//!   "nonce":"..","signature":"<64 hex>"}`, the signature over
//!   `v1|status_answer|nonce|payment_id|order_id|status|amount_cents`
//!   (`flashsale_io::payment::StatusAnswer`). `PAID` (with a payment id) → [`Answer::Paid`];
//!   `UNPAID`, `CLOSED` or `FAILED` → [`Answer::Unpaid`]; anything else, another order id,
//!   another nonce (a replayed answer), a bad signature (a forged answer), a non-200 status, a
//!   malformed body, no answer within the deadline → [`Answer::Unknown`], never "unpaid".
//!
//! Transport: plain HTTP/1.1 over a tokio `TcpStream` (`Connection: close`, one request per
//! connection), for a provider endpoint on loopback or a private network; `https://` is
//! refused at configuration (terminate TLS in a local proxy if the provider needs it). No
//! HTTP client crate is in the build, and this needs only a request and a bounded read.
//!
//! What it is not: what the closer does with the answer (`payments.rs`,
//! `close_due_orders_verified`), nor the callback route (`engine::shard::orders`).

use std::time::Duration;

use flashsale_io::key::HmacKey;
use flashsale_io::payment::{StatusAnswer, StatusRequest};
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::PgError;

/// Largest answer read (headers and body); a provider's answer is a few hundred bytes.
const ANSWER_BYTES_MAX: usize = 16 * 1024;
/// Most attempts per ask (each within `timeout_ms`).
pub const ATTEMPTS_MAX: u32 = 5;

/// The provider's settings (`[payments]`, the payment key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderConfig {
    /// `http://host[:port][/path]`.
    pub status_url: String,
    /// `FLASHSALE_PAYMENT_KEY`: signs the requests, verifies the answers.
    pub key: HmacKey,
    /// Deadline of one attempt: connect, write, read the whole answer.
    pub timeout_ms: u64,
    /// Attempts per ask (1..=[`ATTEMPTS_MAX`]); a connection failure, a deadline or a 5xx is
    /// tried again after `retry_pause_ms`, a signed answer or a 4xx is not.
    pub attempts: u32,
    pub retry_pause_ms: u64,
    /// Backoff before asking again about an order whose answer was unknown: `backoff_min_ms`
    /// doubled per ask so far, at most `backoff_max_ms`.
    pub backoff_min_ms: u64,
    pub backoff_max_ms: u64,
    /// Asks in flight at once within one closer round.
    pub concurrency: usize,
}

impl ProviderConfig {
    /// The defaults for `status_url` and `key`: a 2 s deadline, 2 attempts 200 ms apart (an ask
    /// costs at most ~4.2 s), unknown orders asked again after 5 s, 10 s, ... up to 5 min.
    pub fn new(status_url: impl Into<String>, key: HmacKey) -> ProviderConfig {
        ProviderConfig {
            status_url: status_url.into(),
            key,
            timeout_ms: 2_000,
            attempts: 2,
            retry_pause_ms: 200,
            backoff_min_ms: 5_000,
            backoff_max_ms: 300_000,
            concurrency: 8,
        }
    }

    pub fn validate(&self) -> Result<(), PgError> {
        let bad = |m: String| Err(PgError::Config(m));
        if let Err(why) = StatusUrl::parse(&self.status_url) {
            return bad(format!("payments.status_url {:?}: {why}", self.status_url));
        }
        if self.timeout_ms == 0 || self.timeout_ms > 60_000 {
            return bad("payments.status_timeout_ms must be within 1..=60000".into());
        }
        if !(1..=ATTEMPTS_MAX).contains(&self.attempts) {
            return bad(format!("payments.status_attempts must be within 1..={ATTEMPTS_MAX}"));
        }
        if self.backoff_min_ms == 0 || self.backoff_max_ms < self.backoff_min_ms {
            return bad("payments backoff: 0 < backoff_min_ms <= backoff_max_ms required".into());
        }
        if !(1..=64).contains(&self.concurrency) {
            return bad("payments.status_concurrency must be within 1..=64".into());
        }
        Ok(())
    }

    /// The pause before the next ask after `attempts` asks (1 = the first).
    pub fn backoff_ms(&self, attempts: u32) -> u64 {
        let doublings = attempts.saturating_sub(1).min(40);
        self.backoff_min_ms.saturating_mul(1u64 << doublings).min(self.backoff_max_ms)
    }
}

/// `http://host[:port][/path]`, split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusUrl {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl StatusUrl {
    pub fn parse(url: &str) -> Result<StatusUrl, &'static str> {
        if url.starts_with("https://") {
            return Err("https is not supported (plain http to a local or private endpoint)");
        }
        let rest = url.strip_prefix("http://").ok_or("must start with http://")?;
        let (authority, path) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, "/"),
        };
        if authority.contains('@') {
            return Err("credentials are not supported");
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) => (host, port.parse::<u16>().map_err(|_| "bad port")?),
            None => (authority, 80),
        };
        if host.is_empty() || port == 0 {
            return Err("no host:port");
        }
        if !path.bytes().all(|b| b.is_ascii_graphic()) || path.contains('#') {
            return Err("the path must be visible ASCII without a fragment");
        }
        Ok(StatusUrl { host: host.to_owned(), port, path: path.to_owned() })
    }
}

/// What the provider said about one order, reduced to what the closer acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Paid: apply as the callback `(payment_id, order_id, PAID, amount_cents)`.
    Paid { payment_id: String, amount_cents: u64 },
    /// Authoritatively unpaid (`UNPAID`, `CLOSED`, `FAILED`): close and release.
    Unpaid { status: String },
    /// Nothing authoritative; `why` is for logs and `payment_status_ask.last_answer`.
    Unknown { why: String },
}

impl Answer {
    fn unknown(why: impl Into<String>) -> Answer {
        Answer::Unknown { why: why.into() }
    }
}

/// A configured provider client.
#[derive(Debug, Clone)]
pub struct Provider {
    config: ProviderConfig,
    url: StatusUrl,
}

#[derive(Deserialize)]
struct AnswerBody {
    order_id: String,
    #[serde(default)]
    payment_id: String,
    status: String,
    #[serde(default)]
    amount_cents: u64,
    nonce: String,
    signature: String,
}

impl Provider {
    pub fn new(config: ProviderConfig) -> Result<Provider, PgError> {
        config.validate()?;
        let url = StatusUrl::parse(&config.status_url)
            .map_err(|why| PgError::Config(format!("payments.status_url: {why}")))?;
        Ok(Provider { config, url })
    }

    pub fn config(&self) -> &ProviderConfig {
        &self.config
    }

    /// Asks about `order_id` (see the module documentation). Never fails: every failure is
    /// [`Answer::Unknown`]. Takes at most `attempts × timeout_ms + (attempts − 1) ×
    /// retry_pause_ms`.
    pub async fn ask(&self, order_id: &str, now_ms: u64) -> Answer {
        if order_id.is_empty()
            || !order_id.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
        {
            return Answer::unknown("order id not sendable");
        }
        let mut last = Answer::unknown("not asked");
        for attempt in 1..=self.config.attempts {
            if attempt > 1 {
                tokio::time::sleep(Duration::from_millis(self.config.retry_pause_ms)).await;
            }
            let nonce = hex::encode(rand::random::<[u8; 16]>());
            let request = StatusRequest { order_id, nonce: &nonce, requested_at_ms: now_ms };
            let deadline = Duration::from_millis(self.config.timeout_ms);
            let (answer, retry) = match tokio::time::timeout(deadline, self.call(&request)).await {
                Err(_) => (Answer::unknown("no answer within the deadline"), true),
                Ok(Err(why)) => (Answer::Unknown { why }, true),
                Ok(Ok((status, body))) => self.judge(&request, status, &body),
            };
            last = answer;
            if !retry {
                break;
            }
        }
        metrics::counter!("flashsale_payment_status_asks_total", "answer" => match &last {
            Answer::Paid { .. } => "paid",
            Answer::Unpaid { .. } => "unpaid",
            Answer::Unknown { .. } => "unknown",
        })
        .increment(1);
        last
    }

    /// One HTTP exchange: the status code and the body.
    async fn call(&self, request: &StatusRequest<'_>) -> Result<(u16, Vec<u8>), String> {
        let url = &self.url;
        let mut stream = TcpStream::connect((url.host.as_str(), url.port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let body = request.body(&self.config.key);
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            url.path,
            url.host,
            url.port,
            body.len()
        );
        stream.write_all(head.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        stream.write_all(body.as_bytes()).await.map_err(|e| format!("write: {e}"))?;
        let mut raw = Vec::with_capacity(1024);
        let mut chunk = [0u8; 4096];
        loop {
            let n = stream.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&chunk[..n]);
            if raw.len() > ANSWER_BYTES_MAX {
                return Err("answer too large".into());
            }
            if complete(&raw) {
                break;
            }
        }
        parse_response(&raw)
    }

    /// An HTTP answer judged: the [`Answer`] and whether another attempt may help.
    fn judge(&self, request: &StatusRequest<'_>, status: u16, body: &[u8]) -> (Answer, bool) {
        if status != 200 {
            return (Answer::unknown(format!("HTTP {status}")), status >= 500);
        }
        let Ok(parsed) = serde_json::from_slice::<AnswerBody>(body) else {
            return (Answer::unknown("malformed answer"), false);
        };
        let answer = StatusAnswer {
            nonce: &parsed.nonce,
            payment_id: &parsed.payment_id,
            order_id: &parsed.order_id,
            status: &parsed.status,
            amount_cents: parsed.amount_cents,
        };
        if parsed.order_id != request.order_id || parsed.nonce != request.nonce {
            return (Answer::unknown("answer for another request"), false);
        }
        if !answer.verify(&self.config.key, &parsed.signature) {
            tracing::warn!(
                order_id = request.order_id,
                "payment status answer with a bad signature"
            );
            return (Answer::unknown("bad signature"), false);
        }
        let answer = match parsed.status.as_str() {
            "PAID" if !parsed.payment_id.is_empty() => {
                Answer::Paid { payment_id: parsed.payment_id, amount_cents: parsed.amount_cents }
            }
            "PAID" => Answer::unknown("PAID without a payment id"),
            "UNPAID" | "CLOSED" | "FAILED" => Answer::Unpaid { status: parsed.status },
            other => Answer::unknown(format!("status {other}")),
        };
        (answer, false)
    }
}

/// Whether `raw` holds a whole response by its `Content-Length` (else the read goes to EOF).
fn complete(raw: &[u8]) -> bool {
    let Some(end) = find(raw, b"\r\n\r\n") else { return false };
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    head.lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .is_some_and(|len| raw.len() >= end + 4 + len)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Status code and body of a whole HTTP/1.x response (`Content-Length`, chunked, or to EOF).
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = find(raw, b"\r\n\r\n").ok_or("no complete response head")?;
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    let status_line = head.lines().next().unwrap_or("");
    let mut words = status_line.split_whitespace();
    if !words.next().is_some_and(|v| v.starts_with("http/1.")) {
        return Err("not an HTTP/1 response".into());
    }
    let status = words.next().and_then(|c| c.parse::<u16>().ok()).ok_or("no status code")?;
    let body = &raw[end + 4..];
    let header = |name: &str| {
        head.lines().skip(1).find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    if header("transfer-encoding:").is_some_and(|v| v.contains("chunked")) {
        return dechunk(body).map(|b| (status, b));
    }
    match header("content-length:").map(|v| v.parse::<usize>()) {
        Some(Ok(len)) if body.len() >= len => Ok((status, body[..len].to_vec())),
        Some(_) => Err("short or bad Content-Length body".into()),
        None => Ok((status, body.to_vec())),
    }
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let line_end = find(body, b"\r\n").ok_or("bad chunk")?;
        let size_text = String::from_utf8_lossy(&body[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| "bad chunk size")?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if body.len() < size + 2 {
            return Err("short chunk".into());
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> HmacKey {
        HmacKey::from_hex("00112233445566778899aabbccddeeff").expect("key")
    }

    #[test]
    fn status_urls_parse_and_bad_ones_are_refused() {
        let url = StatusUrl::parse("http://127.0.0.1:8099/pay/status").expect("url");
        assert_eq!(
            (url.host.as_str(), url.port, url.path.as_str()),
            ("127.0.0.1", 8099, "/pay/status")
        );
        let url = StatusUrl::parse("http://provider.internal").expect("url");
        assert_eq!((url.port, url.path.as_str()), (80, "/"));
        for bad in [
            "https://p:1/",
            "ftp://p/",
            "http://:80/",
            "http://u@p:1/",
            "http://p:x/",
            "http://p:1/a b",
        ] {
            assert!(StatusUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn config_bounds_and_the_backoff_doubles_up_to_its_cap() {
        let mut config = ProviderConfig::new("http://127.0.0.1:1/s", key());
        config.validate().expect("defaults");
        assert_eq!(config.backoff_ms(1), 5_000);
        assert_eq!(config.backoff_ms(2), 10_000);
        assert_eq!(config.backoff_ms(60), 300_000);
        config.attempts = 0;
        assert!(config.validate().is_err());
        config.attempts = 1;
        config.backoff_max_ms = 1;
        assert!(config.validate().is_err());
    }

    #[test]
    fn responses_parse_by_length_chunks_or_eof() {
        let raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA";
        assert!(complete(raw));
        assert_eq!(parse_response(raw), Ok((200, b"ok".to_vec())));
        let raw =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n1\r\nc\r\n0\r\n\r\n";
        assert_eq!(parse_response(raw), Ok((200, b"abc".to_vec())));
        assert_eq!(parse_response(b"HTTP/1.0 503 x\r\n\r\ndown"), Ok((503, b"down".to_vec())));
        assert!(parse_response(b"SSH-2.0\r\n\r\n").is_err());
        assert!(!complete(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab"));
    }

    #[test]
    fn answers_are_judged_by_signature_nonce_and_status() {
        let provider =
            Provider::new(ProviderConfig::new("http://127.0.0.1:1/s", key())).expect("provider");
        let request = StatusRequest { order_id: "ord_1", nonce: "n1", requested_at_ms: 1 };
        let body = |status: &str, payment_id: &str, nonce: &str, signer: &HmacKey| {
            let answer =
                StatusAnswer { nonce, payment_id, order_id: "ord_1", status, amount_cents: 5 };
            format!(
                r#"{{"order_id":"ord_1","payment_id":"{payment_id}","status":"{status}","amount_cents":5,"nonce":"{nonce}","signature":"{}"}}"#,
                answer.sign(signer)
            )
        };
        let k = key();
        let judge = |b: String| provider.judge(&request, 200, b.as_bytes()).0;
        assert_eq!(
            judge(body("PAID", "pay_1", "n1", &k)),
            Answer::Paid { payment_id: "pay_1".into(), amount_cents: 5 }
        );
        assert_eq!(judge(body("UNPAID", "", "n1", &k)), Answer::Unpaid { status: "UNPAID".into() });
        assert!(matches!(judge(body("PROCESSING", "", "n1", &k)), Answer::Unknown { .. }));
        assert!(matches!(judge(body("PAID", "", "n1", &k)), Answer::Unknown { .. }));
        // Replayed (another nonce) and forged (another key): unknown, never unpaid.
        assert!(matches!(judge(body("UNPAID", "", "n0", &k)), Answer::Unknown { .. }));
        let forger = HmacKey::from_hex("ff112233445566778899aabbccddeeff").expect("key");
        assert!(matches!(judge(body("UNPAID", "", "n1", &forger)), Answer::Unknown { .. }));
        assert!(provider.judge(&request, 503, b"").1, "5xx is retried");
        assert!(!provider.judge(&request, 404, b"").1);
    }
}

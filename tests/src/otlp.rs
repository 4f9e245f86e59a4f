//! A real OTLP/HTTP trace receiver for the tests (no OpenTelemetry collector is packaged for
//! this machine): it listens on a private loopback port, reads each `POST /v1/traces`, decodes
//! its body as an OTLP `ExportTraceServiceRequest` with the protocol's own protobuf definitions
//! (opentelemetry-proto), keeps every span, and answers 200 with an empty
//! `ExportTraceServiceResponse`, as a collector does. A body that is not a valid request is
//! answered 400 and counted, so a test can assert there was none.
//!
//! [`Collector::Hung`] accepts connections and never reads or answers (a collector stuck in a
//! GC pause or behind a full disk); [`dead_endpoint`] names a port nobody listens on
//! (connection refused).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use prost::Message as _;

/// How the receiver behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collector {
    /// Decodes and keeps every span, answers 200.
    Answering,
    /// Accepts connections, never reads, never answers.
    Hung,
}

/// One span as the receiver decoded it (ids in lowercase hex, "" when absent).
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub name: String,
    pub kind: i32,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub flags: u32,
    pub attributes: BTreeMap<String, String>,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    /// OTLP status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
    /// `service.name` of the span's resource.
    pub service_name: String,
    pub start_ns: u64,
    pub end_ns: u64,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Default)]
struct State {
    spans: Vec<ReceivedSpan>,
    requests: u64,
    bad_requests: u64,
    connections: u64,
    /// A hung collector's connections, held open until it stops.
    held: Vec<TcpStream>,
}

/// The receiver; stops (and closes what it holds) on drop.
pub struct OtlpReceiver {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<State>>,
    thread: Option<JoinHandle<()>>,
}

impl OtlpReceiver {
    pub fn start(mode: Collector) -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(Mutex::new(State::default()));
        let thread = {
            let (stop, state) = (Arc::clone(&stop), Arc::clone(&state));
            std::thread::Builder::new()
                .name("otlp-receiver".into())
                .spawn(move || serve(&listener, mode, &stop, &state))
                .expect("spawn the receiver")
        };
        OtlpReceiver { addr, stop, state, thread: Some(thread) }
    }

    /// The base endpoint, as `FLASHSALE_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.state.lock().unwrap().spans.clone()
    }

    pub fn requests(&self) -> u64 {
        self.state.lock().unwrap().requests
    }

    pub fn bad_requests(&self) -> u64 {
        self.state.lock().unwrap().bad_requests
    }

    pub fn connections(&self) -> u64 {
        self.state.lock().unwrap().connections
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the blocked accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A base endpoint on which nothing listens: a port bound once and released.
pub fn dead_endpoint() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let addr = listener.local_addr().expect("bound address");
    drop(listener);
    format!("http://{addr}")
}

fn serve(listener: &TcpListener, mode: Collector, stop: &AtomicBool, state: &Mutex<State>) {
    for stream in listener.incoming() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let Ok(mut stream) = stream else { continue };
        state.lock().unwrap().connections += 1;
        match mode {
            Collector::Hung => state.lock().unwrap().held.push(stream),
            Collector::Answering => {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let answer = match read_request(&mut stream) {
                    Ok(body) => take(&body, state),
                    Err(_) => false,
                };
                let status = if answer { "200 OK" } else { "400 Bad Request" };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/x-protobuf\r\n\
                     Content-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = stream.write_all(head.as_bytes());
            }
        }
    }
}

/// The body of a `POST /v1/traces` with an OTLP protobuf content type; Err for anything else.
fn read_request(stream: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buf.len() > 64 * 1024 {
            return Err("head too large".into());
        }
        let n = stream.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed in the head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    if !head.starts_with("post /v1/traces http/1.1\r\n")
        || !head.contains("\r\ncontent-type: application/x-protobuf\r\n")
    {
        return Err(format!("not an OTLP/HTTP protobuf trace export: {head}"));
    }
    let length: usize = head
        .split("\r\n")
        .find_map(|line| line.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or("no content-length")?;
    let mut body = buf.split_off(head_end);
    while body.len() < length {
        let n = stream.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed in the body".into());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    Ok(body)
}

/// Decodes an export request and keeps its spans; false when it is not one.
fn take(body: &[u8], state: &Mutex<State>) -> bool {
    let mut state = state.lock().unwrap();
    state.requests += 1;
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        state.bad_requests += 1;
        return false;
    };
    for resource_spans in request.resource_spans {
        let resource =
            resource_spans.resource.map(|r| attributes(&r.attributes)).unwrap_or_default();
        let service_name = resource.get("service.name").cloned().unwrap_or_default();
        for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
            state.spans.push(ReceivedSpan {
                name: span.name,
                kind: span.kind,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: hex(&span.parent_span_id),
                flags: span.flags,
                attributes: attributes(&span.attributes),
                links: span.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect(),
                status_code: span.status.map_or(0, |s| s.code),
                service_name: service_name.clone(),
                start_ns: span.start_time_unix_nano,
                end_ns: span.end_time_unix_nano,
            });
        }
    }
    true
}

fn attributes(list: &[KeyValue]) -> BTreeMap<String, String> {
    list.iter().map(|kv| (kv.key.clone(), value_text(kv.value.as_ref()))).collect()
}

fn value_text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

//! HTTP/1.1 costs on the hot path (`engine::http`): parsing one realistic
//! `POST /v1/reservations`, parsing a pipelined batch of 16 of them the way the
//! connection loop does, and writing a `202 QUEUED` response with its JSON body into a
//! reused buffer.
//!
//! Run: `cargo bench -p flashsale-benches --bench http_parse -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use flashsale_engine::http::{
    parse_request, write_response, Connection, Limits, Parsed, ResponseHead, StateBody, Status,
};

/// A submit as a real client sends it: a ~120-byte user pass, a browser-ish user agent,
/// and the ~90-byte JSON body of CONTRACT.md section 3.2.
const RESERVATION: &[u8] = b"POST /v1/reservations HTTP/1.1\r\n\
Host: api.flashsale.example.com\r\n\
Authorization: Bearer v1.kid-2025-06-rot-b.usr_01J9Z8Q4K7W3M5N2P6R8T0V1XA.10001.1893456000.Xq3lV0m9bN2pQ7rT4wY8zA1cE5gH6jK0sD3fL9uI2oP\r\n\
Content-Type: application/json\r\n\
Content-Length: 95\r\n\
User-Agent: Mozilla/5.0 (X11; Linux x86_64) flashsale-app/3.14.2\r\n\
Accept: application/json\r\n\
\r\n\
{\"activity_id\":10001,\"sku_id\":20001,\"request_id\":\"req_01J9Z8Q4K7W3M5N2P6R8T0V1XA\",\"quantity\":1}";

const PIPELINE_DEPTH: usize = 16;

fn parse_one(criterion: &mut Criterion) {
    let limits = Limits::DEFAULT;
    assert!(
        matches!(parse_request(RESERVATION, &limits), Parsed::Complete { consumed, .. } if consumed == RESERVATION.len()),
        "the bench request must be valid"
    );
    let mut group = criterion.benchmark_group("http_parse");
    group.throughput(Throughput::Elements(1));
    group.bench_function("reservation_post", |bench| {
        bench.iter(|| match parse_request(black_box(RESERVATION), &limits) {
            Parsed::Complete { request, consumed } => {
                black_box((request.authorization, request.body));
                consumed
            }
            Parsed::Incomplete | Parsed::Reject(_) => 0,
        })
    });
    let batch: Vec<u8> = RESERVATION.repeat(PIPELINE_DEPTH);
    group.throughput(Throughput::Elements(PIPELINE_DEPTH as u64));
    group.bench_function("pipelined_batch_of_16", |bench| {
        bench.iter(|| {
            let buf = black_box(batch.as_slice());
            let mut offset = 0;
            let mut parsed = 0;
            while let Parsed::Complete { request, consumed } =
                parse_request(&buf[offset..], &limits)
            {
                black_box(request.body);
                offset += consumed;
                parsed += 1;
            }
            assert_eq!(parsed, PIPELINE_DEPTH);
            offset
        })
    });
    group.finish();
}

fn write_queued(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("http_response");
    group.throughput(Throughput::Elements(1));
    let mut out = BytesMut::with_capacity(64 * 1024);
    let mut body = BytesMut::with_capacity(512);
    group.bench_function("write_202_queued", |bench| {
        bench.iter(|| {
            out.clear();
            body.clear();
            StateBody {
                request_id: Some(black_box("req_01J9Z8Q4K7W3M5N2P6R8T0V1XA")),
                state: "QUEUED",
                reservation_id: Some(black_box("resv_01J9Z8Q4K7W3M5N2P6R8T0V1XB")),
                ..StateBody::default()
            }
            .write_json(&mut body);
            let head = ResponseHead {
                traceparent: Some(black_box(
                    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                )),
                connection: Connection::KeepAlive,
                ..ResponseHead::new(
                    Status::Accepted,
                    black_box("9f2c1d7e-4b1a-4c55-8e0b-3b8f0f6f7a21"),
                )
            };
            write_response(&mut out, &head, &body);
            out.len()
        })
    });
    group.finish();
}

criterion_group!(benches, parse_one, write_queued);
criterion_main!(benches);

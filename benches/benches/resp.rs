//! RESP codec costs on the hot path: encoding one `FCALL reserve` (7 keys, 7 args of the
//! real shapes) by hand into a reused buffer vs. building a `redis-protocol` frame and
//! encoding that, and decoding `reserve` replies.
//!
//! Run: `cargo bench -p flashsale-benches --bench resp -- --warm-up-time 1 --measurement-time 3`.
//! After criterion's own report, a short fixed-iteration pass prints the by-hand/frame ratios
//! measured in the same run (absolute numbers drift on this machine; ratios hold).

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput};
use flashsale_io::resp;
use redis_protocol::resp2::encode::{extend_encode, extend_encode_borrowed};
use redis_protocol::resp2::types::{BorrowedFrame, BytesFrame};

const KEYS: [&[u8]; 7] = [
    b"seckill:{10001:20001}:meta",
    b"seckill:{10001:20001}:stock",
    b"seckill:{10001:20001}:user:8837462",
    b"seckill:{10001:20001}:req:01J9Z8Q4K7W3M5N2P6R8T0V1XA",
    b"seckill:{10001:20001}:resv:01J9Z8Q4K7W3M5N2P6R8T0V1XB",
    b"seckill:{10001:20001}:resv:pending",
    b"seckill:{10001:20001}:soldout",
];

const ARGS: [&[u8]; 7] = [
    b"01J9Z8Q4K7W3M5N2P6R8T0V1XA",
    b"8837462",
    b"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    b"01J9Z8Q4K7W3M5N2P6R8T0V1XB",
    b"01J9Z8Q4K7W3M5N2P6R8T0V1XC",
    b"1750000000123",
    b"2000",
];

/// The CREATED reply of `reserve` as Redis sends it (7 elements, lua/seckill.lua).
const CREATED_REPLY: &[u8] = b"*7\r\n$7\r\nCREATED\r\n$26\r\n01J9Z8Q4K7W3M5N2P6R8T0V1XB\r\n\
$26\r\n01J9Z8Q4K7W3M5N2P6R8T0V1XC\r\n$14\r\nQUEUED_PENDING\r\n$0\r\n\r\n$0\r\n\r\n:41\r\n";

/// A 4-element reply of the same flavour (code, two ids, integer).
const FOUR_REPLY: &[u8] = b"*4\r\n$7\r\nCREATED\r\n$26\r\n01J9Z8Q4K7W3M5N2P6R8T0V1XB\r\n\
$26\r\n01J9Z8Q4K7W3M5N2P6R8T0V1XC\r\n:41\r\n";

fn by_hand(buf: &mut BytesMut) {
    buf.clear();
    resp::encode_fcall(buf, b"reserve", &KEYS, &ARGS);
}

/// What a caller of redis-protocol does per request: the arguments arrive as slices, so
/// the owned frame copies each into its own `Bytes`.
fn via_bytes_frame(buf: &mut BytesMut) {
    buf.clear();
    let mut items = Vec::with_capacity(3 + KEYS.len() + ARGS.len());
    items.push(BytesFrame::BulkString(Bytes::from_static(b"FCALL")));
    items.push(BytesFrame::BulkString(Bytes::from_static(b"reserve")));
    items.push(BytesFrame::BulkString(Bytes::from_static(b"7")));
    for arg in KEYS.iter().chain(ARGS.iter()) {
        items.push(BytesFrame::BulkString(Bytes::copy_from_slice(arg)));
    }
    let frame = BytesFrame::Array(items);
    extend_encode(buf, &frame, false).expect("encode");
}

/// The cheapest redis-protocol path: borrowed frames, no copies, one Vec of frames.
fn via_borrowed_frame(buf: &mut BytesMut) {
    buf.clear();
    let mut items = Vec::with_capacity(3 + KEYS.len() + ARGS.len());
    items.push(BorrowedFrame::BulkString(b"FCALL"));
    items.push(BorrowedFrame::BulkString(b"reserve"));
    items.push(BorrowedFrame::BulkString(b"7"));
    for arg in KEYS.iter().chain(ARGS.iter()) {
        items.push(BorrowedFrame::BulkString(arg));
    }
    let frame = BorrowedFrame::Array(&items);
    extend_encode_borrowed(buf, &frame, false).expect("encode");
}

/// Refills a reused read buffer (as the connection's reader does) and decodes one reply.
/// The previous reply is dropped first, so the buffer reclaims its space without allocating.
fn decode_once(buf: &mut BytesMut, encoded: &[u8]) -> resp::Reply {
    buf.extend_from_slice(encoded);
    resp::decode(buf).expect("valid").expect("complete")
}

fn check_encoders_agree() {
    let (mut a, mut b, mut c) = (BytesMut::new(), BytesMut::new(), BytesMut::new());
    by_hand(&mut a);
    via_bytes_frame(&mut b);
    via_borrowed_frame(&mut c);
    assert_eq!(a, b, "by-hand and frame encodings must be byte-identical");
    assert_eq!(a, c);
    let reply = decode_once(&mut BytesMut::new(), CREATED_REPLY);
    assert_eq!(reply.as_array().map(<[_]>::len), Some(7));
}

fn benches(c: &mut Criterion) {
    let mut group = c.benchmark_group("encode_fcall_reserve");
    group.throughput(Throughput::Elements(1));
    let mut buf = BytesMut::with_capacity(1024);
    group.bench_function("by_hand", |b| b.iter(|| by_hand(black_box(&mut buf))));
    group.bench_function("bytes_frame", |b| b.iter(|| via_bytes_frame(black_box(&mut buf))));
    group.bench_function("borrowed_frame", |b| b.iter(|| via_borrowed_frame(black_box(&mut buf))));
    group.finish();

    let mut group = c.benchmark_group("decode_reserve_reply");
    group.throughput(Throughput::Elements(1));
    for (name, bytes) in [("4_elements", FOUR_REPLY), ("created_7_elements", CREATED_REPLY)] {
        let mut buf = BytesMut::with_capacity(4096);
        group.bench_function(name, |b| b.iter(|| decode_once(&mut buf, black_box(bytes))));
    }
    group.finish();
}

/// Median of 15 runs of `rounds` calls, in ns per call.
fn ns_per_call(rounds: u32, mut f: impl FnMut()) -> f64 {
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..rounds {
                f();
            }
            start.elapsed().as_nanos() as f64 / f64::from(rounds)
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn print_ratios() {
    let mut buf = BytesMut::with_capacity(1024);
    let rounds = 200_000;
    let hand = ns_per_call(rounds, || by_hand(black_box(&mut buf)));
    let owned = ns_per_call(rounds, || via_bytes_frame(black_box(&mut buf)));
    let borrowed = ns_per_call(rounds, || via_borrowed_frame(black_box(&mut buf)));
    println!("\nsame-run medians (ns per FCALL reserve encode):");
    println!("  by hand {hand:.1}, BytesFrame {owned:.1}, BorrowedFrame {borrowed:.1}");
    println!(
        "  ratio BytesFrame/by_hand = {:.2}x, BorrowedFrame/by_hand = {:.2}x",
        owned / hand,
        borrowed / hand
    );
}

fn main() {
    check_encoders_agree();
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    benches(&mut criterion);
    criterion.final_summary();
    print_ratios();
}

//! A minimal blocking PostgreSQL client for the stack's set-up and drills: one simple query
//! over a fresh connection as `postgres` to database `postgres` (trust authentication on
//! loopback only), the rows as text. Like the readiness probe in `server.rs`, it exists so that
//! the starters stay synchronous and need no async runtime.
//!
//! Not here: the application's SQL (it lives in `flashsale_pg_worker`, over tokio-postgres);
//! what the queries are for (`pg_standbys.rs` roles and failovers, `wal_archive.rs` whether a
//! running server archives).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::error::{io_err, StackError};

/// Bound on connecting and on each read of one query.
const SQL_TIMEOUT: Duration = Duration::from_secs(10);

fn service_err(message: String) -> StackError {
    StackError::Service { service: "postgres", message }
}

/// One simple query over a fresh connection as `postgres` to database `postgres`; the rows as
/// text. An ErrorResponse becomes an error naming the server's message.
pub(super) fn simple_query(
    addr: SocketAddr,
    sql: &str,
) -> Result<Vec<Vec<Option<String>>>, StackError> {
    let context = format!("postgres at {addr}");
    let mut stream = TcpStream::connect_timeout(&addr, SQL_TIMEOUT).map_err(io_err(&context))?;
    stream.set_read_timeout(Some(SQL_TIMEOUT)).map_err(io_err(&context))?;
    let mut startup = Vec::with_capacity(96);
    startup.extend_from_slice(&[0; 4]);
    startup.extend_from_slice(&196_608u32.to_be_bytes()); // protocol 3.0
    for s in ["user", "postgres", "database", "postgres", "application_name", "flashsale-stack"] {
        startup.extend_from_slice(s.as_bytes());
        startup.push(0);
    }
    startup.push(0);
    let len = startup.len() as u32;
    startup[0..4].copy_from_slice(&len.to_be_bytes());
    stream.write_all(&startup).map_err(io_err(&context))?;
    read_until_ready(&mut stream, &context)?;
    let mut query = vec![b'Q'];
    query.extend_from_slice(&((sql.len() + 5) as u32).to_be_bytes());
    query.extend_from_slice(sql.as_bytes());
    query.push(0);
    stream.write_all(&query).map_err(io_err(&context))?;
    let rows = read_until_ready(&mut stream, &context)?;
    let _ = stream.write_all(&[b'X', 0, 0, 0, 4]);
    Ok(rows)
}

/// Reads messages up to ReadyForQuery, collecting DataRows; the first ErrorResponse fails.
fn read_until_ready(
    stream: &mut TcpStream,
    context: &str,
) -> Result<Vec<Vec<Option<String>>>, StackError> {
    let mut rows = Vec::new();
    let mut error = None;
    loop {
        let mut head = [0u8; 5];
        stream.read_exact(&mut head).map_err(io_err(context))?;
        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if !(4..=(64 << 20)).contains(&len) {
            return Err(service_err(format!("{context}: bad message length {len}")));
        }
        let mut body = vec![0u8; len - 4];
        stream.read_exact(&mut body).map_err(io_err(context))?;
        match head[0] {
            b'R' if body.get(..4) != Some(&[0, 0, 0, 0]) => {
                return Err(service_err(format!("{context}: asks for a password (trust only)")))
            }
            b'D' => rows
                .push(data_row(&body).ok_or_else(|| service_err(format!("{context}: bad row")))?),
            b'E' if error.is_none() => error = Some(error_message(&body)),
            b'Z' => break,
            _ => {}
        }
    }
    match error {
        Some(message) => Err(service_err(format!("{context}: {message}"))),
        None => Ok(rows),
    }
}

fn data_row(body: &[u8]) -> Option<Vec<Option<String>>> {
    let columns = u16::from_be_bytes([*body.first()?, *body.get(1)?]) as usize;
    let mut at = 2;
    let mut row = Vec::with_capacity(columns);
    for _ in 0..columns {
        let len = i32::from_be_bytes(body.get(at..at + 4)?.try_into().ok()?);
        at += 4;
        if len < 0 {
            row.push(None);
        } else {
            let value = body.get(at..at + len as usize)?;
            row.push(Some(String::from_utf8_lossy(value).into_owned()));
            at += len as usize;
        }
    }
    Some(row)
}

/// The `M` (message) field of an ErrorResponse.
fn error_message(body: &[u8]) -> String {
    body.split(|b| *b == 0)
        .find_map(|field| field.strip_prefix(b"M"))
        .map_or_else(|| "error".to_owned(), |m| String::from_utf8_lossy(m).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_rows_and_errors_decode() {
        // Two columns: "t" and NULL.
        let body = [0, 2, 0, 0, 0, 1, b't', 0xff, 0xff, 0xff, 0xff];
        assert_eq!(data_row(&body), Some(vec![Some("t".to_owned()), None]));
        assert_eq!(data_row(&[0, 1, 0, 0, 0, 9, b'x']), None, "truncated value");
        let error = b"SERROR\0C42601\0Msyntax error at end of input\0\0";
        assert_eq!(error_message(error), "syntax error at end of input");
    }
}

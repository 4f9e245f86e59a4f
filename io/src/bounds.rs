//! The bounds of every id and number that reaches a store from a buyer or an operator,
//! decided once (issue 23): the edge, the admin API, the Lua library and the SQL schema accept
//! exactly these ranges, so a value one of them accepts is a value every later one accepts,
//! and a value outside them is a 400 with its reason at the first place that sees it — never
//! a dependency's refusal and never a circuit opened.
//!
//! Why these numbers:
//! - **Ids** (activity, SKU, buyer) are 1..=[`ID_VALUE_MAX`]: PostgreSQL stores them in
//!   `bigint`, and 64-bit (snowflake) buyer ids are common, so anything narrower would shut
//!   real buyers out. Lua never turns an id into a number (a Lua number holds 15 digits
//!   exactly, not 19): it checks the canonical text against [`ID_VALUE_MAX_TEXT`].
//! - **Times** are Unix milliseconds up to [`TIME_MS_MAX`], the last millisecond of year 9999:
//!   the message schema writes RFC 3339 with four-digit years, PostgreSQL's `timestamptz`
//!   goes far beyond, and it is 15 digits, what the Lua library reads as a number.
//! - **Durations** have business ceilings: a reservation that waits a day for its order, or
//!   an order that waits a week for payment, is a mistake, not a sale.
//! - **Stock** per SKU is what the token table is sized for ([`STOCK_MAX`] tokens).
//!
//! What it is not: validation code. Each boundary validates with these constants in its own
//! terms (serde bodies in the engine, `CHECK`s in SQL, `id_num`/`uint` in `lua/seckill.lua`).

/// Largest id value: ids live in PostgreSQL `bigint` columns.
pub const ID_VALUE_MAX: u64 = i64::MAX as u64;

/// [`ID_VALUE_MAX`] as the Lua library spells it (`ID_VALUE_MAX_TEXT` in `lua/seckill.lua`;
/// a test below checks the library says the same).
pub const ID_VALUE_MAX_TEXT: &str = "9223372036854775807";

/// Most decimal digits of a number the Lua library reads as a number (times, durations,
/// counts, versions): a Lua number (an IEEE double) holds every such integer exactly, and the
/// sum of two stays below 2^53.
pub const LUA_NUMBER_DIGITS_MAX: u32 = 15;

/// Latest instant, in Unix milliseconds: 9999-12-31T23:59:59.999Z.
pub const TIME_MS_MAX: u64 = 253_402_300_799_999;

/// Longest reservation TTL (the time a reservation waits for its order): one day.
pub const RESERVATION_TTL_MS_MAX: u64 = 24 * 3600 * 1000;

/// Longest pay timeout (the time an order waits for its payment): seven days.
pub const PAY_TIMEOUT_MS_MAX: u64 = 7 * 24 * 3600 * 1000;

/// Most units (inventory tokens) one SKU may have, created at once or by top-ups.
pub const STOCK_MAX: u64 = 1_000_000;

/// Most units one buyer may take in one order of one SKU (a SKU's `max_per_buyer` and a
/// reservation's `quantity` are 1..=this): a flash sale's "limit N per customer" is a handful;
/// 100 keeps a batch's units (× the writer's batch size) far from any integer bound.
pub const QUANTITY_MAX: u32 = 100;

/// Highest unit price in cents (ten billion currency units): any price × quantity fits a
/// `bigint` many times over.
pub const PRICE_CENTS_MAX: u64 = 1_000_000_000_000;

/// Highest version of a degradation-mode snapshot: 2^53 - 1, so every JSON reader (also
/// those that parse numbers as doubles) reads it exactly.
pub const MODE_VERSION_MAX: u64 = (1 << 53) - 1;

/// Largest step from a scope's current mode version to the next one accepted (a scope with
/// no snapshot yet counts as version 0). A typo of a few digits can then never freeze a scope
/// by taking all the versions above it; see README "Degradation modes" for the way out.
pub const MODE_VERSION_STEP_MAX: u64 = 1_000_000;

const LUA_NUMBER_MAX: u64 = 10u64.pow(LUA_NUMBER_DIGITS_MAX) - 1;
const _: () = assert!(
    TIME_MS_MAX + RESERVATION_TTL_MS_MAX <= LUA_NUMBER_MAX,
    "a reservation's expiry must be a number the Lua library reads"
);
const _: () = assert!(
    TIME_MS_MAX + PAY_TIMEOUT_MS_MAX <= LUA_NUMBER_MAX,
    "an order's pay deadline must stay within the same range"
);
const _: () = assert!(STOCK_MAX <= LUA_NUMBER_MAX && PRICE_CENTS_MAX < i64::MAX as u64);
const _: () = assert!(MODE_VERSION_STEP_MAX < MODE_VERSION_MAX);

/// The canonical decimal text of an id is within [`ID_VALUE_MAX`] exactly when the Lua
/// library accepts it (`id_num`); used by the tests of both.
pub fn id_text_in_range(text: &str) -> bool {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && !text.starts_with('0')
        && text.len() <= ID_VALUE_MAX_TEXT.len();
    canonical && (text.len() < ID_VALUE_MAX_TEXT.len() || text <= ID_VALUE_MAX_TEXT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lua_library_states_the_same_id_bound() {
        let line = format!("local ID_VALUE_MAX_TEXT = '{ID_VALUE_MAX_TEXT}'");
        assert!(crate::redis::script::LIBRARY.contains(&line), "lua/seckill.lua must say {line}");
        assert_eq!(ID_VALUE_MAX_TEXT, ID_VALUE_MAX.to_string());
    }

    #[test]
    fn id_text_compares_as_its_value() {
        assert!(id_text_in_range("1"));
        assert!(id_text_in_range("1000000000000000"));
        assert!(id_text_in_range(ID_VALUE_MAX_TEXT));
        assert!(!id_text_in_range("9223372036854775808"));
        assert!(!id_text_in_range("10000000000000000000"));
        assert!(!id_text_in_range("0"));
        assert!(!id_text_in_range("01"));
        assert!(!id_text_in_range("+1"));
        assert!(!id_text_in_range(""));
    }

    #[test]
    fn time_bound_is_the_end_of_year_9999() {
        // 10000-01-01T00:00:00Z is 253,402,300,800 s after the epoch.
        assert_eq!(TIME_MS_MAX + 1, 253_402_300_800_000);
    }
}

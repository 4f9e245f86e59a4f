//! The payment provider's statement (seed ch9 §7.10 step 4, "等待支付渠道对账文件"), sans I/O:
//! its CSV format, and what differs between it and what PostgreSQL recorded.
//!
//! The format (CONTRACT.md section 1, `flashsale admin payments reconcile --statement FILE`):
//! UTF-8 text, one header line exactly `payment_id,order_id,amount_cents,status,at`, then one
//! line per payment the provider knows: ids of `[A-Za-z0-9_-]` (1..=`ID_LEN_MAX` bytes, no
//! quoting), `amount_cents` a non-negative integer, `status` one of `PAID`, `FAILED`, `CLOSED`
//! (the provider's authoritative words, as in a callback), `at` an RFC 3339 time. Blank lines
//! are skipped; anything else malformed refuses the whole statement (nothing is applied from
//! a file that cannot be read whole). A `payment_id` listed twice must say the same thing.
//!
//! [`diff`] classifies each line against the facts read for it, and the payments recorded
//! PAID here within the statement's period that it does not list. Each [`Difference`] has an
//! [`Action`]: `Apply` (its line, fed to the payment state machine as a callback, settles it)
//! or `Review` (the machine has no move for it: a person decides).
//!
//! What it is not: reading the facts or applying anything (`payment_reconcile.rs`).

use std::collections::BTreeMap;

use flashsale_io::wire::{parse_rfc3339_ms, ID_LEN_MAX};

/// The statement's header line.
pub const STATEMENT_HEADER: &str = "payment_id,order_id,amount_cents,status,at";

/// Most lines one statement may hold (a sale's payments; split a larger statement by day).
pub const STATEMENT_LINES_MAX: usize = 200_000;

/// Most malformed lines named in a refusal.
const PROBLEMS_SHOWN_MAX: usize = 20;

/// A status the provider's statement may give (the callback's authoritative set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatementStatus {
    Paid,
    Failed,
    Closed,
}

impl StatementStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            StatementStatus::Paid => "PAID",
            StatementStatus::Failed => "FAILED",
            StatementStatus::Closed => "CLOSED",
        }
    }

    fn parse(text: &str) -> Option<StatementStatus> {
        match text {
            "PAID" => Some(StatementStatus::Paid),
            "FAILED" => Some(StatementStatus::Failed),
            "CLOSED" => Some(StatementStatus::Closed),
            _ => None,
        }
    }
}

/// One line of the statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatementLine {
    /// 1-based line number in the file (the header is line 1).
    pub line: usize,
    pub payment_id: String,
    pub order_id: String,
    pub amount_cents: i64,
    pub status: StatementStatus,
    /// The provider's time of the payment (Unix ms).
    pub at_ms: u64,
}

/// A statement read whole, each `payment_id` once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Statement {
    pub lines: Vec<StatementLine>,
}

impl Statement {
    /// The period the statement covers: its earliest and latest `at` (None when empty).
    pub fn period_ms(&self) -> Option<(u64, u64)> {
        let first = self.lines.iter().map(|l| l.at_ms).min()?;
        let last = self.lines.iter().map(|l| l.at_ms).max()?;
        Some((first, last))
    }
}

/// Why a statement was refused: the malformed lines (at most [`PROBLEMS_SHOWN_MAX`] named).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("payment statement refused ({} problem(s)): {}", .count, .shown.join("; "))]
pub struct StatementError {
    pub count: usize,
    pub shown: Vec<String>,
}

/// Parses a whole statement (see the module documentation for the format).
pub fn parse_statement(text: &str) -> Result<Statement, StatementError> {
    let mut problems = Vec::new();
    let mut lines = text.lines().enumerate();
    match lines.next() {
        Some((_, header)) if header.trim_end() == STATEMENT_HEADER => {}
        _ => problems.push(format!("line 1: the header must be exactly {STATEMENT_HEADER:?}")),
    }
    let mut by_payment: BTreeMap<String, usize> = BTreeMap::new();
    let mut statement = Statement::default();
    for (index, raw) in lines {
        let number = index + 1;
        if raw.trim().is_empty() {
            continue;
        }
        if statement.lines.len() == STATEMENT_LINES_MAX {
            problems.push(format!("more than {STATEMENT_LINES_MAX} lines: split the statement"));
            break;
        }
        match parse_line(number, raw.trim_end()) {
            Ok(line) => match by_payment.get(&line.payment_id) {
                Some(&at) if same_payment(&statement.lines[at], &line) => {}
                Some(&at) => problems.push(format!(
                    "line {number}: payment {} differs from line {}",
                    line.payment_id, statement.lines[at].line
                )),
                None => {
                    by_payment.insert(line.payment_id.clone(), statement.lines.len());
                    statement.lines.push(line);
                }
            },
            Err(why) => problems.push(format!("line {number}: {why}")),
        }
    }
    if problems.is_empty() {
        Ok(statement)
    } else {
        let count = problems.len();
        problems.truncate(PROBLEMS_SHOWN_MAX);
        Err(StatementError { count, shown: problems })
    }
}

fn same_payment(a: &StatementLine, b: &StatementLine) -> bool {
    (&a.order_id, a.amount_cents, a.status, a.at_ms)
        == (&b.order_id, b.amount_cents, b.status, b.at_ms)
}

fn parse_line(line: usize, text: &str) -> Result<StatementLine, String> {
    let fields: Vec<&str> = text.split(',').collect();
    let [payment_id, order_id, amount, status, at] = fields[..] else {
        return Err(format!("{} fields, expected 5 ({STATEMENT_HEADER})", fields.len()));
    };
    let id = |name: &str, value: &str| -> Result<String, String> {
        let ok = !value.is_empty()
            && value.len() <= ID_LEN_MAX
            && value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        ok.then(|| value.to_owned()).ok_or_else(|| format!("{name} {value:?} is not an id"))
    };
    let amount_cents = amount
        .parse::<i64>()
        .ok()
        .filter(|a| *a >= 0)
        .ok_or_else(|| format!("amount_cents {amount:?} is not a non-negative integer"))?;
    let status = StatementStatus::parse(status)
        .ok_or_else(|| format!("status {status:?} is not PAID, FAILED or CLOSED"))?;
    let at_ms = parse_rfc3339_ms(at).ok_or_else(|| format!("at {at:?} is not an RFC 3339 time"))?;
    Ok(StatementLine {
        line,
        payment_id: id("payment_id", payment_id)?,
        order_id: id("order_id", order_id)?,
        amount_cents,
        status,
        at_ms,
    })
}

// ---------------------------------------------------------------------------------------------
// The comparison
// ---------------------------------------------------------------------------------------------

/// A payment as PostgreSQL recorded it (`payment` row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedPayment {
    pub order_id: String,
    pub status: String,
    pub amount_cents: i64,
}

/// An order as PostgreSQL holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderFacts {
    pub status: String,
    pub amount_cents: Option<i64>,
}

/// What PostgreSQL knows about one statement line: its `payment_id`'s row and its order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LineFacts {
    pub recorded: Option<RecordedPayment>,
    pub order: Option<OrderFacts>,
}

/// A payment recorded PAID here within the statement's period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaidHere {
    pub payment_id: String,
    pub order_id: String,
    pub amount_cents: i64,
    pub order_status: Option<String>,
}

/// What kind of difference (CONTRACT names, `kind` in the report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DifferenceKind {
    /// PAID there, not recorded here, the order still awaiting payment (PENDING_PAYMENT or
    /// PAYMENT_UNKNOWN): applied, the order becomes PAID.
    PaidThereUnpaidHere,
    /// PAID there, not recorded here, the order CLOSED, CANCELLED, paid by another payment or
    /// unknown: applied, recorded REFUND_NEEDED (money to give back; the unit is not
    /// resurrected).
    PaidThereClosedHere,
    /// PAID there with another amount than the order's (applied: recorded AMOUNT_MISMATCH, the
    /// order PAYMENT_UNKNOWN with its unit, listed for refund), or than the same payment id
    /// recorded here (review).
    AmountMismatch,
    /// FAILED/CLOSED there, not recorded here: applied (a PAYMENT_UNKNOWN order goes back to
    /// PENDING_PAYMENT, and the closer closes it as authoritatively unpaid).
    UnpaidThereNotRecorded,
    /// The same payment id recorded here with another status or order: review.
    StatusConflict,
    /// Recorded PAID here within the statement's period, absent there: review.
    PaidHereAbsentThere,
}

impl DifferenceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DifferenceKind::PaidThereUnpaidHere => "PAID_THERE_UNPAID_HERE",
            DifferenceKind::PaidThereClosedHere => "PAID_THERE_CLOSED_HERE",
            DifferenceKind::AmountMismatch => "AMOUNT_MISMATCH",
            DifferenceKind::UnpaidThereNotRecorded => "UNPAID_THERE_NOT_RECORDED",
            DifferenceKind::StatusConflict => "STATUS_CONFLICT",
            DifferenceKind::PaidHereAbsentThere => "PAID_HERE_ABSENT_THERE",
        }
    }
}

/// What settles a difference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Its statement line, applied as a callback through the payment state machine.
    Apply,
    /// Nothing automatic: the state machine has no move for it (it never un-pays an order).
    Review,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Apply => "APPLY",
            Action::Review => "REVIEW",
        }
    }
}

/// One difference between the statement and PostgreSQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub kind: DifferenceKind,
    pub action: Action,
    pub payment_id: String,
    pub order_id: String,
    /// The statement's line (None for [`DifferenceKind::PaidHereAbsentThere`]).
    pub line: Option<StatementLine>,
    /// The order's status here (None: no such order).
    pub order_status: Option<String>,
    /// The amount here: the recorded payment's, else the order's.
    pub amount_cents_here: Option<i64>,
}

/// The differences, statement lines first (in file order), then the payments absent there.
/// `facts[i]` belongs to `statement.lines[i]`; a line whose payment is recorded exactly as the
/// statement says is no difference (already applied: replaying a statement finds nothing).
pub fn diff(statement: &Statement, facts: &[LineFacts], paid_here: &[PaidHere]) -> Vec<Difference> {
    assert_eq!(statement.lines.len(), facts.len(), "one facts entry per statement line");
    let mut out: Vec<Difference> =
        statement.lines.iter().zip(facts).filter_map(|(l, f)| judge_line(l, f)).collect();
    let listed: std::collections::BTreeSet<&str> =
        statement.lines.iter().map(|l| l.payment_id.as_str()).collect();
    for p in paid_here.iter().filter(|p| !listed.contains(p.payment_id.as_str())) {
        out.push(Difference {
            kind: DifferenceKind::PaidHereAbsentThere,
            action: Action::Review,
            payment_id: p.payment_id.clone(),
            order_id: p.order_id.clone(),
            line: None,
            order_status: p.order_status.clone(),
            amount_cents_here: Some(p.amount_cents),
        });
    }
    out
}

/// One line against its facts; None when they agree.
fn judge_line(line: &StatementLine, facts: &LineFacts) -> Option<Difference> {
    let order_status = facts.order.as_ref().map(|o| o.status.clone());
    let (kind, action, amount_here) = match &facts.recorded {
        Some(r) => {
            let same = r.order_id == line.order_id && r.status == line.status.as_str();
            if same && r.amount_cents == line.amount_cents {
                return None;
            }
            let kind =
                if same { DifferenceKind::AmountMismatch } else { DifferenceKind::StatusConflict };
            (kind, Action::Review, Some(r.amount_cents))
        }
        None => {
            let order_amount = facts.order.as_ref().and_then(|o| o.amount_cents);
            (not_recorded_kind(line, facts.order.as_ref()), Action::Apply, order_amount)
        }
    };
    Some(Difference {
        kind,
        action,
        payment_id: line.payment_id.clone(),
        order_id: line.order_id.clone(),
        line: Some(line.clone()),
        order_status,
        amount_cents_here: amount_here,
    })
}

/// The kind of a line whose payment PostgreSQL has not recorded (each applied as a callback).
fn not_recorded_kind(line: &StatementLine, order: Option<&OrderFacts>) -> DifferenceKind {
    if line.status != StatementStatus::Paid {
        return DifferenceKind::UnpaidThereNotRecorded;
    }
    match order {
        Some(o) if matches!(o.status.as_str(), "PENDING_PAYMENT" | "PAYMENT_UNKNOWN") => {
            if o.amount_cents.is_some_and(|a| a != line.amount_cents) {
                DifferenceKind::AmountMismatch
            } else {
                DifferenceKind::PaidThereUnpaidHere
            }
        }
        _ => DifferenceKind::PaidThereClosedHere,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn statement(body: &str) -> Result<Statement, StatementError> {
        parse_statement(&format!("{STATEMENT_HEADER}\n{body}"))
    }

    #[test]
    fn a_statement_parses_and_refuses_whole() {
        let s = statement(
            "p1,o1,500,PAID,2026-06-25T19:00:00Z\n\np2,o2,0,CLOSED,2026-06-25T19:05:00.5Z\n",
        )
        .unwrap();
        assert_eq!(s.lines.len(), 2);
        assert_eq!((s.lines[0].line, s.lines[1].line), (2, 4));
        assert_eq!(s.period_ms().map(|(a, b)| b - a), Some(300_500));
        let err = statement("p1,o1,500,PAID,2026-06-25T19:00:00Z\np2,o2,-1,PAID,x\np3,o 3,1,REFUNDED,2026-06-25T19:00:00Z")
            .unwrap_err();
        assert_eq!(err.count, 2, "{err}");
        assert!(err.shown[0].starts_with("line 3: amount_cents"), "{err}");
        assert!(parse_statement("order_id,payment_id\n").is_err());
        // The same payment twice: fine when identical, refused when it differs.
        let twice = "p1,o1,5,PAID,2026-06-25T19:00:00Z\np1,o1,5,PAID,2026-06-25T19:00:00Z\n";
        assert_eq!(statement(twice).unwrap().lines.len(), 1);
        assert!(statement("p1,o1,5,PAID,2026-06-25T19:00:00Z\np1,o1,6,PAID,2026-06-25T19:00:00Z")
            .is_err());
    }

    fn order(status: &str, amount: i64) -> Option<OrderFacts> {
        Some(OrderFacts { status: status.into(), amount_cents: Some(amount) })
    }

    #[test]
    fn each_line_is_classified() {
        let s = statement(
            "p1,o1,5,PAID,2026-06-25T19:00:00Z\np2,o2,5,PAID,2026-06-25T19:00:00Z\n\
             p3,o3,9,PAID,2026-06-25T19:00:00Z\np4,o4,5,FAILED,2026-06-25T19:00:00Z\n\
             p5,o5,5,PAID,2026-06-25T19:00:00Z\np6,o6,5,PAID,2026-06-25T19:00:00Z\n\
             p7,o7,7,PAID,2026-06-25T19:00:00Z",
        )
        .unwrap();
        let recorded = |status: &str, amount| RecordedPayment {
            order_id: "o".into(),
            status: status.into(),
            amount_cents: amount,
        };
        let facts = vec![
            LineFacts { recorded: None, order: order("PAYMENT_UNKNOWN", 5) },
            LineFacts { recorded: None, order: order("CLOSED", 5) },
            LineFacts { recorded: None, order: order("PENDING_PAYMENT", 5) },
            LineFacts { recorded: None, order: order("PAYMENT_UNKNOWN", 5) },
            LineFacts { recorded: None, order: None },
            LineFacts {
                recorded: Some(RecordedPayment { order_id: "o6".into(), ..recorded("PAID", 5) }),
                order: order("PAID", 5),
            },
            LineFacts {
                recorded: Some(RecordedPayment { order_id: "o7".into(), ..recorded("PAID", 5) }),
                order: order("PAID", 5),
            },
        ];
        let here = vec![
            PaidHere {
                payment_id: "p6".into(),
                order_id: "o6".into(),
                amount_cents: 5,
                order_status: None,
            },
            PaidHere {
                payment_id: "p9".into(),
                order_id: "o9".into(),
                amount_cents: 5,
                order_status: None,
            },
        ];
        let kinds: Vec<_> = diff(&s, &facts, &here)
            .iter()
            .map(|d| (d.payment_id.clone(), d.kind, d.action))
            .collect();
        use Action::*;
        use DifferenceKind::*;
        let want = [
            ("p1", PaidThereUnpaidHere, Apply),
            ("p2", PaidThereClosedHere, Apply),
            ("p3", AmountMismatch, Apply),
            ("p4", UnpaidThereNotRecorded, Apply),
            ("p5", PaidThereClosedHere, Apply),
            ("p7", AmountMismatch, Review),
            ("p9", PaidHereAbsentThere, Review),
        ];
        let want: Vec<_> = want.iter().map(|(p, k, a)| ((*p).to_owned(), *k, *a)).collect();
        assert_eq!(kinds, want);
    }
}

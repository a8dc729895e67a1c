//! The result budget: how large a tool result may be as sent, and the
//! helpers that cut text and lists to fit it.
//!
//! A tool result goes out as one JSON-RPC message (one SSE event on the
//! Streamable HTTP transport) that carries the structured result twice:
//! as `structuredContent`, and as the text of a `text` content block,
//! where its JSON is escaped once more. Official clients refuse large
//! events: the Python SDK (`mcp` 2.x, `DEFAULT_MAX_SSE_EVENT_SIZE`) any
//! event over 1 MiB. So every result, measured as the `CallToolResult`'s
//! JSON, stays within [`RESULT_BUDGET`] (512 KiB), half that limit:
//!
//! - every tool cuts what can grow (output streams, the Python `repr`,
//!   text and binary chunks, listings, diffs) to fit [`CONTENT_BUDGET`],
//!   and says so with `truncated` and the original size;
//! - [`guard`] replaces any result that still exceeds [`RESULT_BUDGET`]
//!   (e.g. a sandbox with megabytes of labels) by an error, never sends it.
//!
//! Sizes are of the JSON text as serde_json writes it ([`escaped_len`]):
//! a NUL byte costs 6 bytes (`\u0000`), a quote 2, and the text copy of
//! the structured JSON re-escapes its quotes and backslashes, so it is at
//! most twice the structured JSON's size.

use rmcp::model::CallToolResult;
use serde::Serialize;

/// Largest tool result, as the `CallToolResult`'s JSON (bytes): 512 KiB.
/// The JSON-RPC and SSE framing around it adds well under 1 KiB.
pub const RESULT_BUDGET: usize = 512 << 10;

/// Largest structured result a tool builds (its compact JSON, bytes): what
/// fits [`RESULT_BUDGET`] twice more (the text copy re-escapes at most
/// every byte) with 8 KiB to spare for the envelope. 168 KiB.
pub const CONTENT_BUDGET: usize = (RESULT_BUDGET - (8 << 10)) / 3;

/// The bytes `c` takes inside a JSON string as serde_json writes it
/// (RFC 8259 §7): 2 for `"`, `\` and the control characters with a short
/// escape, 6 for other control characters (`\u00XX`), else its UTF-8
/// length.
pub fn escaped_char_len(c: char) -> usize {
    match c {
        '"' | '\\' | '\u{8}' | '\u{c}' | '\n' | '\r' | '\t' => 2,
        c if (c as u32) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

/// The bytes `s` takes as a JSON string, quotes excluded.
pub fn escaped_len(s: &str) -> usize {
    s.chars().map(escaped_char_len).sum()
}

/// The longest prefix of `s` (cut on a character boundary) whose JSON
/// escape takes at most `max` bytes.
pub fn fit_prefix(s: &str, max: usize) -> &str {
    let mut used = 0;
    for (i, c) in s.char_indices() {
        used += escaped_char_len(c);
        if used > max {
            return &s[..i];
        }
    }
    s
}

/// The longest suffix of `s` (cut on a character boundary) whose JSON
/// escape takes at most `max` bytes.
pub fn fit_suffix(s: &str, max: usize) -> &str {
    let mut used = 0;
    for (i, c) in s.char_indices().rev() {
        used += escaped_char_len(c);
        if used > max {
            return &s[i + c.len_utf8()..];
        }
    }
    s
}

/// The lossy UTF-8 text of the longest prefix of `data` whose JSON escape
/// takes at most `max_json` bytes, and how many bytes of `data` it covers
/// (a page of raw process output as text).
///
/// Walks `data` by [`<[u8]>::utf8_chunks`]: each invalid sequence becomes
/// one U+FFFD (3 bytes of JSON, as [`String::from_utf8_lossy`] writes it);
/// a character cut by the end of `data` (the rest may come on the next
/// page) is left out unless `at_end` says no more bytes follow. The next
/// page starts at `offset + covered`; `covered < data.len()` means the
/// page was cut.
pub fn fit_bytes(data: &[u8], max_json: usize, at_end: bool) -> (String, usize) {
    const REPLACEMENT_JSON: usize = 3;
    let mut text = String::new();
    let (mut used, mut covered) = (0usize, 0usize);
    let mut chunks = data.utf8_chunks().peekable();
    while let Some(chunk) = chunks.next() {
        for c in chunk.valid().chars() {
            let n = escaped_char_len(c);
            if used + n > max_json {
                return (text, covered);
            }
            used += n;
            covered += c.len_utf8();
            text.push(c);
        }
        let bad = chunk.invalid();
        if bad.is_empty() {
            continue;
        }
        // An incomplete sequence at the very end: a character the page cut.
        let cut_char = chunks.peek().is_none() && std::str::from_utf8(bad).is_err_and(|e| e.error_len().is_none());
        if (cut_char && !at_end) || used + REPLACEMENT_JSON > max_json {
            return (text, covered);
        }
        used += REPLACEMENT_JSON;
        covered += bad.len();
        text.push(char::REPLACEMENT_CHARACTER);
    }
    (text, covered)
}

/// A text cut to a budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// The text kept.
    pub text: String,
    /// Whether anything was cut.
    pub truncated: bool,
}

/// `s` cut to at most `max` bytes of JSON escape.
pub fn cut(s: String, max: usize) -> Cut {
    let keep = fit_prefix(&s, max).len();
    if keep == s.len() {
        return Cut { text: s, truncated: false };
    }
    let mut s = s;
    s.truncate(keep);
    Cut { text: s, truncated: true }
}

/// The compact JSON size of `v` (bytes); `usize::MAX` if it does not
/// serialize.
pub fn json_len<T: Serialize + ?Sized>(v: &T) -> usize {
    let mut counter = Counter(0);
    match serde_json::to_writer(&mut counter, v) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

/// A writer that only counts bytes.
struct Counter(usize);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps the leading items of `items` whose JSON (with a comma each) fits
/// `max` bytes; returns how many were dropped.
pub fn fit_list<T: Serialize>(items: &mut Vec<T>, max: usize) -> usize {
    let mut used: usize = 2; // []
    let mut keep = items.len();
    for (i, item) in items.iter().enumerate() {
        used = used.saturating_add(json_len(item)).saturating_add(1);
        if used > max {
            keep = i;
            break;
        }
    }
    let dropped = items.len() - keep;
    items.truncate(keep);
    dropped
}

/// The size of `r` as sent (its JSON, bytes).
pub fn result_len(r: &CallToolResult) -> usize {
    json_len(r)
}

/// Passes `r` if it fits [`RESULT_BUDGET`], else replaces it by an error
/// result that names the tool and the sizes. The last line of defence:
/// each tool cuts its own output first.
pub fn guard(tool: &str, r: CallToolResult) -> CallToolResult {
    let len = result_len(&r);
    if len <= RESULT_BUDGET {
        return r;
    }
    tracing::warn!(tool, bytes = len, budget = RESULT_BUDGET, "tool result over the budget: replaced by an error");
    CallToolResult::error(vec![rmcp::model::ContentBlock::text(format!(
        "the result of {tool} is {len} bytes, over the {RESULT_BUDGET}-byte result budget, and was not sent; \
         ask for less (a smaller length, a narrower listing, fewer labels)"
    ))])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suffix_fits_its_json_budget_on_a_character_boundary() {
        assert_eq!(fit_suffix("abc", 10), "abc");
        assert_eq!(fit_suffix("abcdef", 3), "def");
        // "é" is 2 bytes of JSON, a NUL 6 (\u0000).
        assert_eq!(fit_suffix("xéé", 4), "éé");
        assert_eq!(fit_suffix("x\0é", 7), "é");
        assert_eq!(fit_suffix("abc", 0), "");
    }

    #[test]
    fn escaped_len_is_what_serde_json_writes() {
        let mut all: String = (0u32..0x80).filter_map(char::from_u32).collect();
        all.push_str("é€😀\u{7f}\u{2028}\u{fffd}");
        for c in all.chars() {
            let s = c.to_string();
            assert_eq!(escaped_len(&s), serde_json::to_string(&s).unwrap().len() - 2, "{c:?}");
        }
        assert_eq!(escaped_len(&all), serde_json::to_string(&all).unwrap().len() - 2);
    }

    #[test]
    fn cuts_land_on_char_boundaries_within_the_budget() {
        let s = "aé€😀\"\0".repeat(100);
        for max in 0..200 {
            let p = fit_prefix(&s, max);
            assert!(escaped_len(p) <= max);
            let next = s[p.len()..].chars().next().unwrap();
            assert!(escaped_len(p) + escaped_char_len(next) > max, "the prefix is the longest one");
        }
        let c = cut("\0".repeat(1000), 60);
        assert_eq!((c.text.len(), c.truncated), (10, true));
        let c = cut("short".into(), 60);
        assert_eq!((c.text.as_str(), c.truncated), ("short", false));
    }

    #[test]
    fn fit_bytes_covers_what_its_text_shows() {
        // Plain text within the budget: all of it.
        assert_eq!(fit_bytes(b"hello\n", 100, false), ("hello\n".to_string(), 6));
        // Escapes count: each newline is 2 bytes of JSON.
        assert_eq!(fit_bytes(b"\n\n\n", 5, false), ("\n\n".to_string(), 2));
        // A character cut by the page end waits for the next page...
        let euro = "€".as_bytes();
        assert_eq!(fit_bytes(&[b'a', euro[0], euro[1]], 100, false), ("a".to_string(), 1));
        // ...unless nothing follows: then it is one replacement character.
        assert_eq!(fit_bytes(&[b'a', euro[0], euro[1]], 100, true), ("a\u{fffd}".to_string(), 3));
        // Invalid bytes inside the page are replaced, one U+FFFD each
        // sequence, like from_utf8_lossy, and covered.
        let data = b"a\xffb\xc3(c";
        let (text, covered) = fit_bytes(data, 100, false);
        assert_eq!(text, String::from_utf8_lossy(data));
        assert_eq!(covered, data.len());
        // The budget bounds the escaped text, replacements included.
        let (text, covered) = fit_bytes(b"\xff\xff\xff", 7, false);
        assert_eq!((text.chars().count(), covered), (2, 2));
    }

    #[test]
    fn fit_bytes_pages_rebuild_the_stream() {
        let stream: Vec<u8> =
            "line \"é€😀\" \0\x01 ok\n".repeat(200).into_bytes().into_iter().chain([0xff, 0xfe]).collect();
        for (page, budget) in [(64usize, 50usize), (1000, 40), (4096, 4096), (7, 100)] {
            let (mut offset, mut text) = (0usize, String::new());
            while offset < stream.len() {
                let end = (offset + page).min(stream.len());
                let (t, covered) = fit_bytes(&stream[offset..end], budget, end == stream.len());
                assert!(escaped_len(&t) <= budget, "{} > {budget}", escaped_len(&t));
                assert!(covered > 0, "a page always moves on (page {page}, budget {budget}, at {offset})");
                text.push_str(&t);
                offset += covered;
            }
            assert_eq!(text, String::from_utf8_lossy(&stream), "page {page}, budget {budget}");
        }
    }

    #[test]
    fn lists_keep_what_fits() {
        let mut v: Vec<String> = (0..100).map(|i| format!("{i:08}")).collect();
        let dropped = fit_list(&mut v, 1000);
        assert!(json_len(&v) <= 1000);
        assert_eq!(dropped, 100 - v.len());
        assert!(json_len(&v) + 11 > 1000, "as many as fit");
    }

    #[test]
    fn the_guard_passes_small_results_and_refuses_large_ones() {
        let small = CallToolResult::structured(serde_json::json!({"a": "b"}));
        assert_eq!(guard("t", small.clone()), small);
        let big = CallToolResult::structured(serde_json::json!({"a": "\0".repeat(RESULT_BUDGET / 8)}));
        let r = guard("t", big);
        assert_eq!(r.is_error, Some(true));
        assert!(result_len(&r) < 1024);
    }

    #[test]
    fn content_within_its_budget_makes_a_result_within_the_result_budget() {
        // The worst case for the text copy: every byte a quote.
        let worst = "\"".repeat(CONTENT_BUDGET / 2 - 16);
        let value = serde_json::json!({ "s": worst });
        assert!(json_len(&value) <= CONTENT_BUDGET);
        assert!(result_len(&CallToolResult::structured(value)) <= RESULT_BUDGET);
    }
}
